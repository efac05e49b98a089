"""Delta sync end to end: the reference trainer takes real AdamW steps, the engine (bf16)
receives only changed elements, and after every step its weights are bitwise what a full
sync would give (checksums against the trainer's values cast to bf16)."""

from __future__ import annotations

import datetime
import functools

import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.training import OptimConfig, grpo_loss
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from shardsync.config import DeltaConfig, SyncConfig, TransportConfig
from shardsync.sync import WeightSync
from tests.dist._engine import owner, shard_bytes, start_engine, stop_engine
from tests.dist._world import free_port, run_world


def _trainer(rank: int, world: int, port: int, url: str, transport: str, delta_dir: str | None, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    par = MegatronParallel(tp=world, dtype="float32")
    groups = megatron_groups(par)
    model = TrainerModel(spec, par, rank, groups.tp, groups.pp, source=random_source(spec, 0),
                         optim=OptimConfig(lr=1e-5))
    sync = WeightSync(spec, par, rank, dict(model.named_parameters()), [url],
                      SyncConfig(delta=DeltaConfig(transport=transport, dir=delta_dir),
                                 transport=TransportConfig(bucket_mb=0.25, timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res: dict = {"modes": [], "verify": [], "density": []}
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, spec.vocab_size, (4, 12), generator=g)
    mask = torch.ones(4, 11)
    for version in range(1, 5):
        if version > 1:
            old = model.policy_logprobs(ids)
            adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
            model.train_step(ids, functools.partial(grpo_loss, old_logprobs=old, advantages=adv, mask=mask))
        if version == 4:
            sync.synced_version = 2  # a missed step: the engine holds 3, so this update must be full
        rec = sync.update(version)
        res["modes"].append(rec.mode)
        if rec.delta:
            res["density"].append(rec.delta["engine_changed"])
        res["verify"].append(sync.verify())
    if rank == 0 and transport != "disk":
        info = httpx.get(url + "/weights/version", timeout=10).json()
        plan = sync.topo.p2p_plan if transport == "p2p" else sync.topo.broadcast_plan
        r = httpx.post(url + "/weights/begin", headers=owner(), timeout=10, json={
            "version": 9, "mode": f"delta-{transport}", "fingerprint": plan.fingerprint, "base_version": 1})
        res["wrong_base"] = (r.status_code, r.text, info["weight_version"])
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize("transport,staging", [("p2p", "0"), ("broadcast", "0"), ("disk", "0"),
                                               ("disk", "shard"), ("p2p", "window")],
                         ids=["p2p", "broadcast", "disk", "disk-staged", "p2p-window"])
def test_delta_after_real_optimizer_steps_is_bitwise_full(transport: str, staging: str, tmp_path) -> None:
    """``shard``: the engine receives into staging and swaps at commit, so each delta must
    apply to a staging copy first caught up from the served weights (the previous version);
    ``window``: a third of the shard staged so, the rest scattered in place after the pause."""
    delta_dir = str(tmp_path / "versions") if transport == "disk" else None
    budget = {"0": 0, "shard": -1, "window": shard_bytes("tiny-qwen3", 2, "bfloat16") // 3}[staging]
    proc, url = start_engine("tiny-qwen3", 2, dtype="bfloat16", delta_root=str(tmp_path), staging_bytes=budget)
    try:
        res = run_world(_trainer, 2, args=(2, free_port(), url, transport, delta_dir), timeout=240)
        r0 = res[0]
        full = "p2p"  # full updates take p2p whenever its preconditions hold
        assert r0["modes"] == [full, f"delta-{transport}", f"delta-{transport}", full], r0["modes"]
        assert all(v == [] for v in r0["verify"]), r0["verify"]
        assert all(n > 0 for n in r0["density"]), "an optimizer step changes some bf16 elements"
        if transport == "disk":
            # versions 2 and 3 were published as files; 4 went through the group (full)
            published = sorted(p.name for p in (tmp_path / "versions").iterdir())
            assert published == ["v000002", "v000003"], published
            r = httpx.post(url + "/weights/pull", headers=owner(), timeout=10, json={"root": delta_dir, "version": 3})
            assert r.status_code == 409 and "not newer than the engine's 4" in r.text  # an old version
        else:
            status, text, version = r0["wrong_base"]
            assert status == 409 and "send a full update" in text and version == 4
        assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    finally:
        stop_engine(proc)
