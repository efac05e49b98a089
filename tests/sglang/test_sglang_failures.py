"""The SGLang receiver's failure paths: SGLang keeps running (nothing escapes the loader),
the update is reported failed, generation is not continued, and the weights SGLang holds
are what its own loader made of the last good version (or a full update restores them).
A rank whose layout is not shardsync's takes whole tensors through SGLang's own loader."""

from __future__ import annotations

import os
import time

import pytest
import torch.distributed as dist

from shardsync.config import ControlConfig, DeltaConfig, SyncConfig, TransportConfig
from shardsync.control.client import SyncError
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.dist._world import free_port, join_trainer, run_world
from tests.sglang import _models
from tests.sglang.test_sglang_sync import TOKEN, start_servers
from tests.vllm._check import version_source

MODEL = "tiny-qwen3"
TRAINER = MegatronParallel(tp=2, dtype="float32")


@pytest.fixture(scope="module")
def sglang():
    (server,) = start_servers(MODEL, engines=((2, 1),))
    yield server
    server.stop()


def _config(timeout_s: float = 30, token: str = TOKEN, http_s: float = 60) -> SyncConfig:
    return SyncConfig(control=ControlConfig(channel="sglang", token=token, http_timeout_s=http_s),
                      transport=TransportConfig(bucket_mb=0.25, timeout_s=timeout_s))


def _one_rank_sync(url: str, cfg: SyncConfig) -> WeightSync:
    spec = _models.SPECS[MODEL]
    par = MegatronParallel(tp=1, dtype="float32")
    params = load_rank(Topology(spec, par).trainer_layout, 0, version_source(spec, 0))
    return WeightSync(spec, par, 0, params, [url], cfg)


def _trainer(rank: int, world: int, port: int, url: str, version: int, out) -> None:
    spec = _models.SPECS[MODEL]
    lay, params = join_trainer(rank, world, port, spec, TRAINER, seed=0)
    for k, v in load_rank(lay, rank, version_source(spec, version)).items():
        params[k].copy_(v)
    sync = WeightSync(spec, TRAINER, rank, params, [url], _config(), trainer_group=dist.group.WORLD)
    sync.connect()
    rec = sync.update(version)
    res = {"ok": rec.ok, "mismatched": sync.verify(), "mode": rec.mode, "fallback": sync.fallback_reason,
           "destination": rec.engines[0].destination}
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _sync(url: str, version: int) -> dict:
    return run_world(_trainer, TRAINER.world_size, args=(TRAINER.world_size, free_port(), url, version),
                     timeout=300)[0]


def test_wrong_fingerprint_refused_sglang_untouched(sglang, monkeypatch) -> None:
    before = sglang.weight_version
    monkeypatch.setattr(Topology, "fingerprint", lambda self, mode: "0" * 16)
    sync = _one_rank_sync(sglang.url, _config())
    with pytest.raises(SyncError, match="fingerprint mismatch"):
        sync.connect()
    sync.close()
    assert sglang.dead is None and sglang.session is None and sglang.weight_version == before
    assert sglang.compare_version(0) == [[], []]  # still what SGLang loaded at start


def test_connect_signed_with_another_token_gets_no_answer(sglang) -> None:
    sync = _one_rank_sync(sglang.url, _config(token="another-token-0123456789", http_s=3))
    with pytest.raises(SyncError, match="did not answer the connect check"):
        sync.connect()
    sync.close()
    assert sglang.dead is None and sglang.session is None


def test_update_failing_on_sglang_is_reported_and_not_continued(sglang, monkeypatch) -> None:
    """An update whose plan fingerprint the ranks do not know: every rank refuses it before
    touching a weight, the trainer reads why, SGLang stays paused on its weights."""
    assert _sync(sglang.url, 4)["ok"]
    sync = _one_rank_sync(sglang.url, _config(timeout_s=6))
    sync.connect()
    monkeypatch.setattr(Topology, "fingerprint", lambda self, mode: "f" * 16)  # not what the ranks joined
    with pytest.raises(SyncError, match="does not match the connected plan.*stays paused"):
        sync.update(5)
    monkeypatch.undo()
    sync.close()
    assert sglang.dead is None and sglang.paused, "a failed update must not continue generation"
    assert sglang.weight_version == "4"
    assert sglang.compare_version(4) == [[], []]  # refused before any byte landed


def _dies_mid_update(rank: int, world: int, port: int, url: str, out) -> None:
    """Connect, then rank 0 starts an update on SGLang and every rank exits before sending."""
    spec = _models.SPECS[MODEL]
    _, params = join_trainer(rank, world, port, spec, TRAINER, seed=0)
    sync = WeightSync(spec, TRAINER, rank, params, [url], _config(timeout_s=6), trainer_group=dist.group.WORLD)
    sync.connect()
    if rank == 0:
        from shardsync.control.wire import BeginRequest
        from shardsync.mode import Mode
        sync._channel.begin(BeginRequest(version=50, mode=Mode.P2P, fingerprint=sync.topo.fingerprint("p2p")))
        time.sleep(1)  # SGLang's ranks are inside the receive
    out.put((rank, {}))
    time.sleep(1)  # the result reaches the parent (a queue's feeder thread), then:
    os._exit(0)  # a killed trainer: no close, no goodbye


def test_trainer_killed_mid_update_leaves_sglang_paused_then_recovers(sglang) -> None:
    assert _sync(sglang.url, 6)["ok"]
    run_world(_dies_mid_update, TRAINER.world_size, args=(TRAINER.world_size, free_port(), sglang.url), timeout=120)
    deadline = time.monotonic() + 60  # the ranks wait for bytes that never come, then give up
    while sglang.session is not None and not sglang.session["loaded"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sglang.dead is None, f"SGLang died: {sglang.dead}"
    assert sglang.paused, "a cut update must leave SGLang paused"
    assert sglang.weight_version == "6"
    res = _sync(sglang.url, 7)  # a new trainer: the left-open session is closed, a full update
    assert res["ok"] and res["mismatched"] == []
    assert sglang.compare_version(7) == [[], []]
    assert not sglang.paused and sglang.weight_version == "7"


def test_layout_mismatch_takes_whole_tensors_through_sglang_loader() -> None:
    (server,) = start_servers(MODEL, engines=((2, 1),), SHARDSYNC_SGLANG_LAYOUT="whole")
    try:
        res = _sync(server.url, 8)
        assert res["mode"] == "broadcast" and "SHARDSYNC_SGLANG_LAYOUT" in res["fallback"]
        assert res["ok"] and res["mismatched"] == [] and res["destination"] == "loader"
        assert server.compare_version(8) == [[], []]
    finally:
        server.stop()


def test_disk_delta_lands_on_sglang_with_its_base_from_the_manifest(sglang, tmp_path) -> None:
    """A delta published on disk: every rank checks the manifest's base against the version it
    holds (the reference engine's rule, through the same session) and applies its parts."""
    spec = _models.SPECS[MODEL]
    cfg = SyncConfig(delta=DeltaConfig(transport="disk", dir=str(tmp_path)),
                     control=ControlConfig(channel="sglang", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.25, timeout_s=30))
    sync = _one_rank_sync(sglang.url, cfg)
    sync.connect()
    try:
        lay = sync.topo.trainer_layout
        _load(sync.params, load_rank(lay, 0, version_source(spec, 20)))
        full = sync.update(20)
        _load(sync.params, load_rank(lay, 0, version_source(spec, 21, 20)))
        delta = sync.update(21)
        assert full.ok and full.mode == "p2p", full.error
        assert delta.ok and delta.mode == "delta-disk", delta.error
        assert sync.verify() == []
    finally:
        sync.close()
    assert sglang.compare_version(21, base=20) == [[], []]
    assert sglang.weight_version == "21" and not sglang.paused


def _load(params, values) -> None:
    for k, v in values.items():
        params[k].copy_(v)
