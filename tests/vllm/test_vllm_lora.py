"""A TP 2 LoRA trainer taking real GRPO steps syncs its adapter into a real, unmodified vLLM (TP 1
and TP 2) serving that adapter (``--enable-lora --lora-modules policy=DIR``).  After every update
vLLM's greedy tokens and logprobs with the adapter equal transformers + PEFT on the trainer's
current adapter (fp32: tokens identical, logprobs within 1e-5); the base is never sent; a trainer
killed mid-sync leaves the previous adapter serving."""

from __future__ import annotations

import datetime
import tempfile
import time

import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.engines.vllm import serve
from shardsync.layout import MegatronParallel
from shardsync.lora import Lora, adapter_tensors, megatron_adapter_layout
from shardsync.models.checkpoint import write_checkpoint
from shardsync.models.training import OptimConfig
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from shardsync.receiver import peft_dir
from shardsync.sync import WeightSync
from shardsync.views import views_of
from tests.dist._peft import grpo_step, lora_trainer, peft_greedy, whole_model_refusal
from tests.dist._world import free_port, run_world
from tests.dist.test_lora_sync import _merge
from tests.vllm._check import MAX_TOKENS, PROMPTS, compare, vllm_generate

SPEC = PRESETS["tiny-qwen3"]
LORA = Lora(rank=8, alpha=16.0, targets=("q_proj", "v_proj", "o_proj", "down_proj"))
TOKEN = "vllm-test-token-0123456789abcdef"  # vLLM's workers read it from $SHARDSYNC_TOKEN
NAME = "policy"  # the adapter's name in vLLM (--lora-modules NAME=DIR), what requests ask for


def _adapter0() -> dict[str, torch.Tensor]:
    source = random_source(SPEC, 3, shapes=adapter_tensors(SPEC, LORA))
    return {n: source(n) for n in adapter_tensors(SPEC, LORA)}


@pytest.fixture(scope="module", params=[1, 2], ids=["vllm-tp1", "vllm-tp2"])
def vllm_lora(request, tmp_path_factory):
    ckpt = write_checkpoint(SPEC, random_source(SPEC, 0), tmp_path_factory.mktemp("ckpt"))
    adapter_dir = tmp_path_factory.mktemp("adapter")
    peft_dir.write_dir(adapter_dir, LORA, _adapter0())
    log = tempfile.NamedTemporaryFile(prefix="vllm-lora-", suffix=".log", delete=False).name
    server = serve.VllmServer(str(ckpt), tp=request.param, lora=serve.LoraModule(NAME, str(adapter_dir), LORA.rank),
                              env={"SHARDSYNC_TOKEN": TOKEN})
    proc, url = serve.start(server, log_path=log)
    yield {"url": url, "model": str(ckpt), "tp": request.param, "dir": adapter_dir}
    serve.stop(proc)


def _trainer(rank: int, world: int, port: int, url: str, out) -> None:
    model, par = lora_trainer(SPEC, LORA, rank, world, port)
    control = ControlConfig(channel="vllm", token=TOKEN)
    res: dict = {"adapters": [], "records": [], "verify": [], "generated": []}
    res["whole_refused"] = whole_model_refusal(SPEC, par, rank, model, [url], SyncConfig(
        control=control, transport=TransportConfig(timeout_s=30)))
    sync = WeightSync(SPEC, par, rank, model.adapter_tensors(), [url],
                      SyncConfig(lora=LORA, control=control, transport=TransportConfig(bucket_mb=0.25, timeout_s=60)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res["connected"], res["fallback"] = sync.mode.value, sync.fallback_reason
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, SPEC.vocab_size, (4, 12), generator=g)
    for version in range(1, 4):
        if version > 1:
            grpo_step(model, ids)
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "adapter": rec.adapter, "pause_s": rec.pause_s})
        res["verify"].append(sync.verify())
        res["adapters"].append({n: t.detach().clone() for n, t in model.adapter_tensors().items()})
        if rank == 0:
            res["generated"].append(vllm_generate(url, NAME))
            res.setdefault("weight_info", []).append(httpx.get(url + "/weight_info", timeout=10).json())
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _peft_greedy(adapter: dict[str, torch.Tensor]) -> list[tuple[list[int], list[float]]]:
    return peft_greedy(SPEC, random_source(SPEC, 0), LORA, adapter, PROMPTS, MAX_TOKENS)


def test_adapter_sync_into_vllm_serves_what_peft_computes(vllm_lora) -> None:
    res = run_world(_trainer, 2, args=(2, free_port(), vllm_lora["url"]), timeout=400)
    r0 = res[0]
    assert "shardsync syncs its adapter alone" in r0["whole_refused"], r0["whole_refused"]
    # vLLM's LoRA layers shard the adapter themselves: every worker takes it whole
    assert r0["connected"] == "broadcast" and "whole adapter" in (r0["fallback"] or ""), r0
    layout = megatron_adapter_layout(SPEC, LORA, MegatronParallel(tp=2, dtype="float32"))
    for v in range(3):
        rec = r0["records"][v]
        assert rec["ok"] and r0["verify"][v] == [], (v, rec, r0["verify"][v])
        assert rec["adapter"]["base_bytes"] > 20 * rec["adapter"]["adapter_bytes"], rec
        assert rec["pause_s"] > 0, rec  # vLLM's pause, from its answer to the pause to its answer to the resume
        adapter = _merge(layout, {r: res[r]["adapters"][v] for r in range(2)})
        assert compare(r0["generated"][v], _peft_greedy(adapter)) is None, v
        assert r0["weight_info"][v]["weight_version"] == str(v + 1)
        on_disk = peft_dir.read_weights(vllm_lora["dir"])
        if v == 2:  # the directory vLLM reloads from holds the last version, bit for bit
            assert all(torch.equal(on_disk[n], adapter[n]) for n in adapter), "adapter directory"
    assert r0["generated"][0] != r0["generated"][2]  # the GRPO steps changed what vLLM serves


def _fsdp2_peft_trainer(rank: int, world: int, port: int, url: str, out) -> None:
    """transformers + PEFT's LoraConfig under ``fully_shard`` (2 ranks): the sync reads its adapter's shards."""
    from shardsync.layout import Fsdp2Parallel
    from shardsync.lora import from_peft
    from shardsync.models.fsdp2_trainer import Fsdp2Trainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    par = Fsdp2Parallel(shard=world, dtype="float32")
    trainer = Fsdp2Trainer(SPEC, par, random_source(SPEC, 0), optim=OptimConfig(lr=1e-2), lora=LORA, lora_seed=4)
    sync = WeightSync(SPEC, par, rank, trainer.adapter_shards(), [url],
                      SyncConfig(lora=LORA, control=ControlConfig(channel="vllm", token=TOKEN),
                                 transport=TransportConfig(timeout_s=60)), trainer_group=dist.group.WORLD)
    sync.connect()
    ids = torch.randint(0, SPEC.vocab_size, (4, 12), generator=torch.Generator().manual_seed(7))
    res: dict = {"steps": []}
    for version in range(1, 3):
        if version > 1:  # a GRPO step: PEFT's B leaves zero, so vLLM's outputs leave the base's
            grpo_step(trainer, ids)
        rec = sync.update(version)
        adapter = {from_peft(n): p.full_tensor().detach() for n, p in trainer.model.named_parameters()
                   if p.requires_grad}  # the test's reference only
        step = {"ok": rec.ok, "verify": sync.verify(), "adapter": adapter}
        if rank == 0:
            step["generated"] = vllm_generate(url, NAME)
        res["steps"].append(step)
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_fsdp2_peft_trainer_into_vllm(vllm_lora) -> None:
    got = run_world(_fsdp2_peft_trainer, 2, args=(2, free_port(), vllm_lora["url"]), timeout=400)
    steps = got[0]["steps"]
    for s in steps:
        assert s["ok"] and s["verify"] == [], s
        assert compare(s["generated"], _peft_greedy(s["adapter"])) is None
    assert any(t.abs().max() > 0 for n, t in steps[1]["adapter"].items() if ".lora_B." in n)  # trained


def _dies_mid_update(rank: int, world: int, port: int, url: str, out) -> None:
    """Connect an adapter sync, then rank 0 opens an update on vLLM and every rank exits
    before sending a byte."""
    import os
    import time

    from shardsync.control.wire import BeginRequest
    from shardsync.models.weights import load_rank
    from shardsync.topology import Topology
    from tests.dist._world import join_trainer

    par = MegatronParallel(tp=world, dtype="float32")
    join_trainer(rank, world, port, SPEC, par, seed=0)
    params = load_rank(Topology(SPEC, par, views=views_of(None, LORA)).trainer_layout, rank,
                       random_source(SPEC, 50, shapes=adapter_tensors(SPEC, LORA)))
    sync = WeightSync(SPEC, par, rank, params, [url],
                      SyncConfig(lora=LORA, control=ControlConfig(channel="vllm", token=TOKEN),
                                 transport=TransportConfig(timeout_s=8)), trainer_group=dist.group.WORLD)
    sync.connect()
    if rank == 0:
        mode = sync.mode
        sync._channel.begin(BeginRequest(version=50, mode=mode, fingerprint=sync.topo.fingerprint(mode.value)))
    out.put((rank, {}))
    time.sleep(1)  # the result reaches the parent (a queue's feeder thread), then:
    os._exit(0)  # a killed trainer: no close, no goodbye


def test_trainer_killed_mid_adapter_sync_leaves_the_old_adapter(vllm_lora) -> None:
    """vLLM stays paused on the failed update (its control's policy); the adapter directory it
    reloads from still holds the last synced adapter, and a resume serves exactly that one."""
    url = vllm_lora["url"]
    before = peft_dir.read_weights(vllm_lora["dir"])
    version = httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]
    run_world(_dies_mid_update, 2, args=(2, free_port(), url), timeout=120)
    assert httpx.get(url + "/is_paused", timeout=60).json()["is_paused"], "a failed update leaves vLLM paused"
    assert httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] == version
    after = peft_dir.read_weights(vllm_lora["dir"])
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)
    deadline = time.monotonic() + 60  # the workers give up on the missing bytes (the sync timeout)
    while True:
        r = httpx.post(url + "/resume", timeout=30)
        if r.status_code == 200 and not httpx.get(url + "/is_paused", timeout=10).json()["is_paused"]:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(1)
    assert compare(vllm_generate(url, NAME), _peft_greedy(before)) is None


def test_lora_benchmark_runs_into_vllm(tmp_path) -> None:
    """``benchmarks/lora_update.py --engine vllm`` (CI's smoke run of it: the main suite has no vLLM)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "lora_vllm.json"
    r = subprocess.run([sys.executable, "benchmarks/lora_update.py", "--engine", "vllm", "--model", "tiny-qwen3",
                        "--rank", "8", "--updates", "1", "--warmup", "0", "--engine-tp", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "vLLM TP1" in r.stdout and "adapter r8" in r.stdout, r.stdout
    full, adapter = json.loads(out.read_text())["results"]
    assert full["checksum_ok"] and adapter["checksum_ok"]
    assert adapter["mode"] == "broadcast" and adapter["bytes"] < full["bytes"] / 10, (full, adapter)
    assert adapter["pause_median_s"] > 0
