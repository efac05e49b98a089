"""Begin/finish through the sync group's store (``control="store"``, the default) and through
HTTP: the same updates land bitwise, a refused begin leaves the engine serving its version,
and the next update goes through."""

from __future__ import annotations

import contextlib

import httpx
import pytest
import torch

from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.sync import SyncError, WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine

SPEC, PAR = PRESETS["tiny-qwen2"], MegatronParallel(tp=1)


@contextlib.contextmanager
def _connected(config: SyncConfig):
    """A TP-1 reference engine and a connected TP-1 trainer (its layout and parameters)."""
    torch.set_num_threads(1)
    lay = Topology(SPEC, PAR).trainer_layout
    proc, url = start_engine("tiny-qwen2", 1)
    try:
        params = load_rank(lay, 0, random_source(SPEC, seed=8))
        sync = WeightSync(SPEC, PAR, 0, params, [url], config)
        sync.connect()
        yield sync, lay, params, url
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("control", ["store", "http"])
def test_updates_and_a_refused_begin(control: str) -> None:
    config = SyncConfig(control=ControlConfig(channel=control), transport=TransportConfig(timeout_s=20))
    with _connected(config) as (sync, lay, params, url):
        assert sync.update(2).engines[0].ok and sync.verify() == []
        with pytest.raises(SyncError, match="older than the engine's 2"):
            sync.update(1)
        r = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 2  # refused: still serving 2
        fresh = load_rank(lay, 0, random_source(SPEC, seed=9))
        for k, v in params.items():
            v.copy_(fresh[k])
        rec = sync.update(3)  # the connection survived the refusal
        assert rec.ok and rec.engines[0].version == 3 and sync.verify() == []
        sync.close()


def test_control_must_be_known() -> None:
    with pytest.raises(ValueError, match="control channel must be one of"):
        ControlConfig(channel="grpc")


def test_an_update_waits_for_a_running_generation_instead_of_timing_out() -> None:
    """Accepted only when the engine is ready to receive: a long generation in progress delays
    the update (crossing policy ``finish``: it waits up to commit_wait_s, 30 s), it does not
    fail it (its transfer timeout, 2 s here, starts afterwards)."""
    import threading
    import time

    with _connected(SyncConfig(transport=TransportConfig(timeout_s=2))) as (sync, _, _, url):
        assert sync.update(1).ok
        answer: dict = {}

        def generate() -> None:  # ~6 s on the CI machines, past the 2 s transfer timeout
            body = {"prompts": [[1, 2, 3]] * 8, "max_new_tokens": 120, "temperature": 0.0}
            answer["r"] = httpx.post(url + "/generate", json=body, timeout=300)

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(0.5)  # the generation is running
        rec = sync.update(2)
        worker.join(300)
        assert rec.ok and sync.verify() == []
        # the generation ran first, on version 1: the update waited behind it and then landed
        assert answer["r"].status_code == 200, answer["r"].text
        assert answer["r"].json()["weight_version"] == 1
        sync.close()
