"""End to end: a real engine server (subprocess, TP workers) and trainer ranks (spawned),
connected by WeightSync over gloo; bitwise checksums after p2p and broadcast updates."""

from __future__ import annotations

import datetime
import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.config import SyncConfig, TransportConfig
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world


def _trainer(rank: int, world: int, port: int, url: str, case: dict, out) -> None:
    spec = PRESETS[case["model"]]
    par = MegatronParallel(**case["trainer"], dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=11)
    sync = WeightSync(spec, par, rank, params, [url], SyncConfig(mode=case["mode"], detail=True,
                                                                   transport=TransportConfig(bucket_mb=0.05, timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"mode": sync.mode, "records": [], "verify": []}
    for version in (1, 2):
        fresh = load_rank(lay, rank, random_source(spec, seed=100 + version))
        for k, v in params.items():
            v.copy_(fresh[k])  # in place: the sync reads the parameters where they live
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "mode": rec.mode, "phases": rec.phases,
                               "bytes_sent": rec.bytes_sent, "links": rec.link_bytes, "steps": rec.steps,
                               "engines": rec.engines_json()})
        res["verify"].append(sync.verify())
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize("mode", ["p2p", "broadcast"])
def test_trainer_tp2_engine_tp2(mode: str) -> None:
    proc, url = start_engine("tiny-qwen3", 2)
    try:
        case = {"model": "tiny-qwen3", "trainer": {"tp": 2}, "mode": mode}
        results = run_world(_trainer, 2, args=(2, free_port(), url, case), timeout=180)
        for rank, res in results.items():
            assert res["mode"] == mode
            assert all(r["ok"] for r in res["records"])
            assert res["verify"] == [[], []], f"rank {rank}: checksum mismatch {res['verify']}"
        r0 = results[0]["records"][-1]
        assert set(r0["phases"]) >= {"plan", "pack", "transfer", "unpack", "control", "total"}
        assert sum(r0["links"].values()) > 0
        # per-bucket detail: every step this rank ran, with its link, bytes and phase times
        assert r0["steps"] and all({"label", "link", "bytes", "pack_s", "transfer_s", "unpack_s"} <= set(s)
                                   for s in r0["steps"])
        assert sum(s["bytes"] for s in r0["steps"]) >= r0["bytes_sent"]
        assert r0["engines"] and all(e["ok"] and e["total_s"] > 0 for e in r0["engines"])
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2, 3]], "max_new_tokens": 3},
                         timeout=30).json()
        assert gen["weight_version"] == 2
    finally:
        stop_engine(proc)


def _trainer_grow(rank: int, world: int, port: int, urls: list[str], relay: bool, out) -> None:
    spec = PRESETS["tiny-qwen2"]
    par = MegatronParallel(tp=2, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=21)
    sync = WeightSync(spec, par, rank, params, urls[:1], SyncConfig(relay=relay, transport=TransportConfig(bucket_mb=0.05, timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    sync.update(1)
    fresh = load_rank(lay, rank, random_source(spec, seed=22))
    for k, v in params.items():
        v.copy_(fresh[k])
    sync.add_engine(urls[1])  # a TP-1 engine joins the TP-2 one mid-run
    rec = sync.update(2)
    res = {"mode": rec.mode, "engines": len(rec.engines), "verify": sync.verify(),
           "trainer_bytes": rec.bytes_sent, "plan_bytes": sync.topo.p2p_plan.bytes_per_src().get(rank, 0)}
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize("relay", [False, True], ids=["direct", "relay"])
def test_two_engines_of_different_tp_and_one_added_mid_run(relay: bool) -> None:
    a, url_a = start_engine("tiny-qwen2", 2)
    b, url_b = start_engine("tiny-qwen2", 1, seed=99)  # starts from other weights
    try:
        results = run_world(_trainer_grow, 2, args=(2, free_port(), [url_a, url_b], relay), timeout=180)
        assert results[0]["mode"] == "p2p" and results[0]["engines"] == 2
        assert results[0]["verify"] == [] and results[1]["verify"] == []
        for r in (0, 1):  # with relay the trainer ranks send one engine's worth, not two
            assert results[r]["trainer_bytes"] == results[r]["plan_bytes"]
        sent = sum(results[r]["trainer_bytes"] for r in (0, 1))
        engines = (EngineParallel(tp=2), EngineParallel(tp=1))
        plans = {x: Topology(PRESETS["tiny-qwen2"], MegatronParallel(tp=2), engines, relay=x).p2p_plan
                 for x in (False, True)}
        assert sent == plans[relay].total_bytes
        assert plans[True].total_bytes < 0.51 * plans[False].total_bytes  # one copy instead of two
        for url in (url_a, url_b):
            r = httpx.post(url + "/generate", json={"prompts": [[4, 5]], "max_new_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["weight_version"] == 2
        same = {"prompts": [[4, 5, 6]], "max_new_tokens": 4, "temperature": 0.0}
        outs = [httpx.post(u + "/generate", json=same, timeout=30).json()["outputs"] for u in (url_a, url_b)]
        assert outs[0][0]["tokens"] == outs[1][0]["tokens"], "both engines hold the same weights"
    finally:
        stop_engine(a)
        stop_engine(b)
