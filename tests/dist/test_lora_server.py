"""An adapter sync end to end: ``WeightSync(SyncConfig(lora=...))`` on a TP 2 LoRA trainer taking
real GRPO steps, into a reference engine server of TP 2 serving that adapter on its own base
(``--lora-rank``), staged.  After every update the engine's greedy tokens and logprobs equal
transformers + PEFT on the trainer's current adapter (fp32: tokens identical, logprobs within
1e-5), ``verify`` finds nothing, and the record moved the adapter's bytes, not the base's.  A
trainer that syncs the whole model into it (or another adapter) is refused at connect, by name."""

from __future__ import annotations

import datetime
import time

import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.config import SyncConfig, TransportConfig
from shardsync.control.client import SyncError
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.lora import Lora, adapter_tensors, engine_adapter_layout, megatron_adapter_layout
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.training import OptimConfig
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from shardsync.sync import WeightSync
from shardsync.views import views_of
from tests.dist._engine import start_engine, stop_engine
from tests.dist._peft import grpo_step, lora_trainer, peft_greedy, whole_model_refusal
from tests.dist._world import free_port, run_world
from tests.dist.test_lora_sync import _merge

SPEC = PRESETS["tiny-qwen3"]
LORA = Lora(rank=8, alpha=16.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
PAR = MegatronParallel(tp=2, dtype="float32")
PROMPTS = [[5, 17, 300, 42, 9], [801, 3, 64]]
NEW = 6



def _trainer(rank: int, world: int, port: int, url: str, out) -> None:
    model, par = lora_trainer(SPEC, LORA, rank, world, port)
    assert par == PAR
    res: dict = {"adapters": [], "records": [], "verify": [], "generated": []}
    res["whole_refused"] = whole_model_refusal(SPEC, PAR, rank, model, [url],
                                               SyncConfig(transport=TransportConfig(timeout_s=30)))
    sync = WeightSync(SPEC, PAR, rank, model.adapter_tensors(), [url],
                      SyncConfig(lora=LORA, transport=TransportConfig(bucket_mb=0.25, timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SPEC.vocab_size, (4, 12), generator=g)
    for version in range(1, 4):
        if version > 1:
            grpo_step(model, ids)
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "adapter": rec.adapter, "bytes": sum(rec.link_bytes.values()),
                               "summary": rec.summary()})
        res["verify"].append(sync.verify())
        res["adapters"].append({n: t.detach().clone() for n, t in model.adapter_tensors().items()})
        if rank == 0:
            r = httpx.post(url + "/generate", timeout=60,
                           json={"prompts": PROMPTS, "max_new_tokens": NEW, "temperature": 0.0})
            res["generated"].append(r.json())
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _peft_greedy(adapter: dict[str, torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    return peft_greedy(SPEC, random_source(SPEC, 0), LORA, adapter, PROMPTS, NEW)


@pytest.fixture
def lora_engine():
    proc, url = start_engine("tiny-qwen3", 2, seed=0, lora=LORA, staging_bytes=-1)
    yield url
    stop_engine(proc)


def test_adapter_sync_serves_what_peft_computes(lora_engine: str) -> None:
    res = run_world(_trainer, 2, args=(2, free_port(), lora_engine), timeout=240)
    r0 = res[0]
    assert "serves adapter" in r0["whole_refused"] and "--lora-rank" in r0["whole_refused"], r0["whole_refused"]
    layout = megatron_adapter_layout(SPEC, LORA, PAR)
    adapter_bytes = sum(t.numel() for t in _merge(layout, {0: res[0]["adapters"][0], 1: res[1]["adapters"][0]}
                                                  ).values()) * 4
    engine = engine_adapter_layout(SPEC, LORA, EngineParallel(tp=2, dtype=SPEC.dtype))
    held = sum(t.numel for r in engine.ranks for t in r.tensors) * 4
    for v in range(3):
        rec = r0["records"][v]
        assert rec["ok"] and r0["verify"][v] == [], (v, rec, r0["verify"][v])
        assert rec["adapter"]["adapter_bytes"] == adapter_bytes and rec["adapter"]["base_bytes"] > 20 * adapter_bytes
        assert rec["bytes"] == held, rec  # p2p: each engine rank its adapter shard, nothing of the base
        assert "not moved" in rec["summary"]
        expected = _peft_greedy(_merge(layout, {r: res[r]["adapters"][v] for r in range(2)}))
        outputs = r0["generated"][v]["outputs"]
        assert r0["generated"][v]["weight_version"] == v + 1
        for (tokens, lps), got in zip(expected, outputs, strict=True):
            assert got["tokens"] == tokens, (v, got["tokens"], tokens)
            assert max(abs(a - b) for a, b in zip(got["logprobs"], lps, strict=True)) < 1e-5, v
    assert r0["generated"][0]["outputs"] != r0["generated"][2]["outputs"]  # the steps changed what is served


@pytest.mark.demos  # ~20 s each: CI runs the demos as their own step
@pytest.mark.parametrize("trainer", [(), ("--trainer", "fsdp2", "--trainer-dp", "2")], ids=["megatron", "fsdp2-peft"])
def test_demo_trains_and_syncs_an_adapter(tmp_path, trainer: tuple[str, ...]) -> None:
    """``shardsync demo --lora 8``: GRPO on the adapter, p2p and broadcast every step, each checked
    bitwise and by the engine re-scoring the batch as the trainer does; ``fsdp2-peft``: the trainer
    is transformers + PEFT's LoraConfig under ``fully_shard``, the sync reads its adapter's shards."""
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--lora", "8", "--steps", "2", *trainer,
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "adapter-only sync: LoRA rank 8" in r.stdout and "versions 1, 2" in r.stdout, r.stdout
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    for row in rows:
        for mode in ("p2p", "broadcast"):
            u = row["updates"][mode]
            assert u["path"] == mode and u["checksum_ok"] is True and u["logprob_abs_diff"] < 1e-5, (row["step"], u)
            assert u["adapter"]["rank"] == 8 and u["bytes"] < u["adapter"]["base_bytes"] / 10


UPDATES = 8


def _adapter_v(version: int):
    return random_source(SPEC, 100 + version, shapes=adapter_tensors(SPEC, LORA))


def _swapping_trainer(rank: int, world: int, port: int, url: str, out) -> None:
    from shardsync.models.weights import load_rank
    from shardsync.topology import Topology
    from tests.dist._world import join_trainer

    join_trainer(rank, world, port, SPEC, PAR, seed=0)
    lay = Topology(SPEC, PAR, views=views_of(None, LORA)).trainer_layout
    params = load_rank(lay, rank, _adapter_v(0))
    sync = WeightSync(SPEC, PAR, rank, params, [url],
                      SyncConfig(mode="p2p", lora=LORA, transport=TransportConfig(bucket_mb=0.05, timeout_s=60)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res: dict = {"ok": [], "begun": {}, "done": {}}
    for version in range(1, UPDATES + 1):
        for name, t in load_rank(lay, rank, _adapter_v(version)).items():
            params[name].copy_(t)
        res["begun"][version] = time.monotonic()
        res["ok"].append(sync.update(version).ok)
        res["done"][version] = time.monotonic()
        time.sleep(0.15)
    res["verify"] = sync.verify()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_clients_generating_across_adapter_swaps_get_one_adapter_per_response() -> None:
    """Three clients generate while the trainer swaps in 8 adapters (staged, ``--crossing finish``):
    every response comes from one adapter version, committed while it ran, and every token's
    logprob is the trainer model's with that version's adapter."""
    import threading

    from shardsync.models.trainer import TrainerModel
    from tests.dist.test_serving import _client

    proc, url = start_engine("tiny-qwen3", 2, seed=0, lora=LORA, staging_bytes=-1, crossing="finish")
    stop, got, errors = threading.Event(), [], []
    clients = [threading.Thread(target=_client, args=(url, stop, i, got, errors), daemon=True) for i in range(3)]
    try:
        httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1}, timeout=30)
        for c in clients:
            c.start()
        res = run_world(_swapping_trainer, 2, args=(2, free_port(), url), timeout=300)
        stop.set()
        for c in clients:
            c.join(60)
    finally:
        stop.set()
        stop_engine(proc)
    r0 = res[0]
    assert all(r0["ok"]) and r0["verify"] == [] and errors == [], (r0, errors[:3])
    done = {int(k): v for k, v in r0["done"].items()}
    models: dict[int, TrainerModel] = {}
    worst, versions = 0.0, set()
    for resp in got:
        out = resp["outputs"][0]
        assert len(out["spans"]) == 1, f"a response mixes adapters: {out['spans']}"
        v = out["spans"][0]["version"]
        versions.add(v)
        assert v + 1 not in done or resp["sent"] <= done[v + 1], f"adapter {v} served after {v + 1} was committed"
        if v not in models:
            models[v] = TrainerModel(SPEC, MegatronParallel(), source=random_source(SPEC, 0), lora=LORA)
            if v:  # version 0: the engine's zeroed adapter (PEFT's start: the base model)
                models[v].load_adapter(_adapter_v(v))
        seq = resp["prompt"] + out["tokens"]
        logp = torch.log_softmax(models[v].logits(torch.tensor([seq]))[0], dim=-1)
        n = len(resp["prompt"])
        worst = max([worst] + [abs(float(logp[n + i - 1, tok]) - out["logprobs"][i])
                               for i, tok in enumerate(out["tokens"])])
    assert len(versions) >= UPDATES // 2, sorted(versions)
    assert worst < 1e-4, worst
