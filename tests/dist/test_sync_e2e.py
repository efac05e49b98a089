"""End to end: a real engine server (subprocess, TP workers) and trainer ranks (spawned),
connected by WeightSync over gloo; bitwise checksums after p2p and broadcast updates."""

from __future__ import annotations

import datetime
import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.spec import PRESETS
from shardsync.sync import SyncConfig, WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, run_world


def _trainer(rank: int, world: int, port: int, url: str, case: dict, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    spec = PRESETS[case["model"]]
    par = MegatronParallel(**case["trainer"], dtype="float32")
    lay = Topology(spec, par).trainer_layout
    params = load_rank(lay, rank, random_source(spec, seed=11))
    sync = WeightSync(spec, par, rank, params, [url], SyncConfig(mode=case["mode"], bucket_mb=0.05,
                                                                   timeout_s=30),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"mode": sync.mode, "records": [], "verify": []}
    for version in (1, 2):
        fresh = load_rank(lay, rank, random_source(spec, seed=100 + version))
        for k, v in params.items():
            v.copy_(fresh[k])  # in place: the sync reads the parameters where they live
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "mode": rec.mode, "phases": rec.phases,
                               "bytes_sent": rec.bytes_sent, "links": rec.link_bytes})
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
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2, 3]], "max_new_tokens": 3},
                         timeout=30).json()
        assert gen["weight_version"] == 2
    finally:
        stop_engine(proc)
