"""Colocated IPC into an FP8 reference engine on CPU (shared memory): ``map`` (the engine reads the
e4m3 words and scales the trainer quantized, in place) and ``push`` (the trainer writes them into
the engine's whole staging copy, which its commit swaps in).  After every update the engine's FP8
bytes and scales are the trainer's quantization (checksums, bitwise) and it serves them, also where
the trainer's shards cut blocks (those blocks arrive wide and the engine quantizes them)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch.distributed as dist

from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.presets import load_spec
from shardsync.sync import WeightSync
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world
from tests.fp8_straddle import STRADDLE, straddle_config

MODEL = "tiny-qwen3-fp8"


def _trainer(rank: int, world: int, port: int, url: str, model: str, ipc: str, out) -> None:
    spec = load_spec(model)
    par = MegatronParallel(tp=world, dtype="bfloat16")
    _, params = join_trainer(rank, world, port, spec, par, seed=5)
    cfg = SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc=ipc), detail=True,
                     transport=TransportConfig(timeout_s=60))
    sync = WeightSync(spec, par, rank, params, [url], cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    assert sync.topo is not None and sync.topo.fp8 is not None
    res: dict = {"records": [], "verify": [], "split": sorted(sync.topo.fp8.split)}
    name = next(n for n in params if n.endswith("linear_fc1.weight"))
    for version in (1, 2, 3):
        params[name].mul_(1.5)  # a step: the weights move, their FP8 bytes and scales with them
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "error": rec.error, "changed": rec.quantized_changed,
                               "destinations": [e.destination for e in rec.engines]})
        res["verify"].append(sync.verify())
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize(("ipc", "staging", "straddle"), [("map", 0, False), ("push", -1, False), ("push", -1, True)])
def test_colocated_ipc_into_an_fp8_engine(ipc: str, staging: int, straddle: bool, tmp_path: Path) -> None:
    model, engine_tp = MODEL, 2
    if straddle:  # engine TP 1: its own shards must be whole blocks (SGLang refuses others)
        model, engine_tp = straddle_config(tmp_path), 1
    proc, url = start_engine(model, engine_tp, dtype="bfloat16", quantization="fp8", staging_bytes=staging)
    try:
        results = run_world(_trainer, 2, args=(2, free_port(), url, model, ipc), timeout=240)
        for rank, res in results.items():
            assert all(r["ok"] for r in res["records"]), res["records"]
            assert res["verify"] == [[], [], []], (rank, res["verify"])
            assert all(r["changed"] > 0 for r in res["records"])
            assert all(d == "quantized" for r in res["records"] for d in r["destinations"])
            # the straddling model moves q_proj and o_proj in cells (the engine quantizes the cut ones)
            assert len(res["split"]) == (2 * STRADDLE.num_layers if straddle else 0), res["split"]
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2, 3]], "max_new_tokens": 3}, timeout=30)
        assert gen.status_code == 200 and gen.json()["weight_version"] == 3
    finally:
        stop_engine(proc)
