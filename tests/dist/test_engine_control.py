"""Begin/finish through the sync group's store (``control="store"``, the default) and through
HTTP: the same updates land bitwise, a refused begin leaves the engine serving its version,
and the next update goes through."""

from __future__ import annotations

import httpx
import pytest
import torch

from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.spec import PRESETS
from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.sync import SyncError, WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine


@pytest.mark.parametrize("control", ["store", "http"])
def test_updates_and_a_refused_begin(control: str) -> None:
    torch.set_num_threads(1)
    spec = PRESETS["tiny-qwen2"]
    par = MegatronParallel(tp=1)
    lay = Topology(spec, par).trainer_layout
    proc, url = start_engine("tiny-qwen2", 1)
    try:
        params = load_rank(lay, 0, random_source(spec, seed=8))
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(control=ControlConfig(channel=control),
                                                                      transport=TransportConfig(timeout_s=20)))
        sync.connect()
        assert sync.update(2).engines[0]["ok"] and sync.verify() == []
        with pytest.raises(SyncError, match="older than the engine's 2"):
            sync.update(1)
        r = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 2  # refused: still serving 2
        fresh = load_rank(lay, 0, random_source(spec, seed=9))
        for k, v in params.items():
            v.copy_(fresh[k])
        rec = sync.update(3)  # the connection survived the refusal
        assert rec.ok and rec.engines[0]["version"] == 3 and sync.verify() == []
        sync.close()
    finally:
        stop_engine(proc)


def test_control_must_be_known() -> None:
    with pytest.raises(ValueError, match="control channel must be one of"):
        ControlConfig(channel="grpc")


def test_an_update_waits_for_a_running_generation_instead_of_timing_out() -> None:
    """Accepted only when the engine is ready to receive: a long generation in progress delays
    the update, it does not fail it (its transfer timeout, 2 s here, starts afterwards)."""
    import threading
    import time

    torch.set_num_threads(1)
    spec = PRESETS["tiny-qwen2"]
    par = MegatronParallel(tp=1)
    lay = Topology(spec, par).trainer_layout
    proc, url = start_engine("tiny-qwen2", 1)
    try:
        params = load_rank(lay, 0, random_source(spec, seed=8))
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(transport=TransportConfig(timeout_s=2)))
        sync.connect()
        assert sync.update(1).ok
        answer: dict = {}

        def generate() -> None:
            body = {"prompts": [[1, 2, 3]] * 8, "max_new_tokens": LONG_TOKENS, "temperature": 0.0}
            t0 = time.perf_counter()
            answer["r"] = httpx.post(url + "/generate", json=body, timeout=300)
            answer["s"] = time.perf_counter() - t0

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.5)  # the generation is running
        rec = sync.update(2)
        worker.join(300)
        assert answer["s"] > 2.5, f"the generation took {answer['s']:.1f}s: too short to test anything"
        assert rec.ok and sync.verify() == []
        assert answer["r"].status_code == 200 and answer["r"].json()["weight_version"] == 1
        sync.close()
    finally:
        stop_engine(proc)


LONG_TOKENS = 1024
