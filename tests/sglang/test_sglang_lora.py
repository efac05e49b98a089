"""A TP 2 LoRA trainer taking GRPO steps syncs its adapter into SGLang engines of TP 1 and TP 2
serving that adapter (``--lora-paths policy=DIR``, SGLang's own LoRA manager and torch-native LoRA
backend on CPU).  After every update each rank's LoRA memory-pool slot equals, bit for bit, what
SGLang's own ``load_lora_adapter_from_tensors`` makes of the trainer's adapter; the adapter's
directory holds it; SGLang reloaded it by name while paused.  A whole-model sync into these
engines is refused at connect.  The server is the stand-in of ``test_sglang_sync`` (SGLang's
server needs a GPU build); models, LoRA manager, loaders and schemas are SGLang's own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.layout.logical import logical_tensors
from shardsync.lora import Lora, adapter_tensors, megatron_adapter_layout
from shardsync.models.weights import random_source
from shardsync.receiver import peft_dir
from shardsync.sync import WeightSync
from tests.dist._peft import grpo_step, lora_trainer, whole_model_refusal
from tests.dist._world import free_port, run_world
from tests.dist.test_lora_sync import _merge
from tests.sglang import _models
from tests.sglang.fake_server import FakeSglang
from tests.sglang.test_sglang_sync import TOKEN, _ctx

SPEC = _models.SPECS["tiny-qwen3"]
LORA = Lora(rank=8, alpha=16.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
NAME = "policy"


@pytest.fixture(scope="module")
def sglang_lora(tmp_path_factory):
    """SGLang TP 1 and TP 2, each serving the adapter from its own directory."""
    initial = {n: random_source(SPEC, 0)(n) for n in logical_tensors(SPEC)}
    source = random_source(SPEC, 3, shapes=adapter_tensors(SPEC, LORA))
    started = []
    for tp in (1, 2):
        root = tmp_path_factory.mktemp(f"adapter-tp{tp}")
        peft_dir.write_dir(root, LORA, {n: source(n) for n in adapter_tensors(SPEC, LORA)})
        lora = {"name": NAME, "path": str(root), "rank": LORA.rank, "targets": list(LORA.targets)}
        started.append(FakeSglang(SPEC, tp, initial, lora=lora, ctx=_ctx(),
                                  env={"SHARDSYNC_TOKEN": TOKEN, "SHARDSYNC_SGLANG_LORA_DIR": str(root)}))
    yield started
    for s in started:
        s.stop()


def _trainer(rank: int, world: int, port: int, urls: list[str], out) -> None:
    model, par = lora_trainer(SPEC, LORA, rank, world, port)
    control = ControlConfig(channel="sglang", token=TOKEN)
    res: dict = {"adapters": [], "records": []}
    res["whole_refused"] = whole_model_refusal(SPEC, par, rank, model, urls, SyncConfig(
        control=control, transport=TransportConfig(timeout_s=30)))
    sync = WeightSync(SPEC, par, rank, model.adapter_tensors(), urls,
                      SyncConfig(lora=LORA, control=control, transport=TransportConfig(timeout_s=60)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res["connected"], res["fallback"] = sync.mode.value, sync.fallback_reason
    ids = torch.randint(0, SPEC.vocab_size, (4, 12), generator=torch.Generator().manual_seed(7))
    for version in range(1, 4):
        if version > 1:
            grpo_step(model, ids)
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "verify": sync.verify(), "adapter": rec.adapter, "pause_s": rec.pause_s})
        res["adapters"].append({n: t.detach().clone() for n, t in model.adapter_tensors().items()})
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_adapter_sync_lands_in_sglang_lora_pool_bit_for_bit(sglang_lora) -> None:
    urls = [s.url for s in sglang_lora]
    res = run_world(_trainer, 2, args=(2, free_port(), urls), timeout=400)
    r0 = res[0]
    assert "SGLang serves LoRA adapters" in r0["whole_refused"], r0["whole_refused"]
    # SGLang's LoRA manager shards the adapter itself: every rank takes it whole
    assert r0["connected"] == "broadcast" and "whole adapter" in (r0["fallback"] or ""), r0
    layout = megatron_adapter_layout(SPEC, LORA, MegatronParallel(tp=2, dtype="float32"))
    config = peft_dir.config_of(LORA)
    for v in range(3):
        rec = r0["records"][v]
        assert rec["ok"] and rec["verify"] == [] and rec["pause_s"] > 0, (v, rec)
        adapter = _merge(layout, {r: res[r]["adapters"][v] for r in range(2)})
        peft = {peft_dir.PEFT_PREFIX + n: t for n, t in adapter.items()}
        for server in sglang_lora:  # the pools are read after the run: the last version, on every rank
            if v == 2:
                assert server.compare_adapter(peft, config) == [[] for _ in range(server.tp)], server.tp
                on_disk = peft_dir.read_weights(server.lora["path"])
                assert all(torch.equal(on_disk[n], adapter[n]) for n in adapter)
    for server in sglang_lora:
        routes = [path for path, _ in server.events]
        assert routes.count("/unload_lora_adapter") == routes.count("/load_lora_adapter") == 3, routes
    assert not all(torch.equal(res[0]["adapters"][0][n], res[0]["adapters"][2][n]) for n in res[0]["adapters"][0])
