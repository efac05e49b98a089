"""Adapter-only sync (``lora/``, ``Topology.lora``): a TP 2 Megatron-layout trainer with LoRA on
every linear (frozen base, AdamW on the adapter) takes real GRPO steps and syncs its adapter,
alone, into reference engines of TP 1 and 2 (in place, and staged: received while serving,
swapped at commit) over p2p and broadcast, in one spawned gloo world.

After every update the engine's adapter is bitwise the trainer's, its base is the one it
loaded, it received the adapter's bytes and nothing else, and its logits equal transformers +
PEFT on the trainer's current adapter (fp32).  The TP 2 trainer's steps equal a TP 1 trainer's
(Megatron's LoRA sharding: replicated halves' gradients summed over TP)."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist

from shardsync.engine.worker import SHARD, destination_of
from shardsync.layout import EngineParallel, Layout, MegatronParallel
from shardsync.lora import Lora, adapter_tensors, engine_adapter_layout, megatron_adapter_layout
from shardsync.mode import Mode
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.training import OptimConfig, grpo_loss
from shardsync.models.weights import random_source
from shardsync.paths import Endpoint, UpdateArgs, compile_path
from shardsync.plan.local import region
from shardsync.presets import PRESETS
from shardsync.receiver import Receiver, connect_request
from shardsync.runtime.schedule import subgroups
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.views import views_of
from tests.dist._compare import rel
from tests.dist._peft import peft_model
from tests.dist._world import free_port, run_world

SECRET = "a-test-secret-0123456789"
SPEC = PRESETS["tiny-qwen3"]
LORA = Lora(rank=8, alpha=16.0)
TRAINER = MegatronParallel(tp=2, dtype="float32")
MODES = (Mode.P2P, Mode.BROADCAST, Mode.P2P)  # one update per version, a train step between
OPTIM = OptimConfig(lr=1e-3)


def _base():
    return random_source(SPEC, 1)


def _adapter():
    """A trained-looking adapter (PEFT starts B at zero: every update would look alike)."""
    return random_source(SPEC, 2, shapes=adapter_tensors(SPEC, LORA))


def _batch() -> tuple[torch.Tensor, functools.partial]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, SPEC.vocab_size, (4, 10), generator=g)
    return ids, functools.partial(grpo_loss, advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                                  mask=torch.ones(4, 9))


def _train(model: TrainerModel) -> dict[str, torch.Tensor]:
    """One GRPO step; returns the adapter's gradients (synced, before clipping)."""
    ids, loss = _batch()
    model.forward_backward(ids, functools.partial(loss, old_logprobs=model.policy_logprobs(ids).detach()))
    model.finish_grad_sync()
    grads = {n: t.grad.clone() for n, t in model.adapter_tensors().items()}
    model.optimizer_step()
    return grads


def _merge(layout: Layout, shards: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole logical tensors from the ranks' local ones (each piece placed once)."""
    full = {n: torch.zeros(s) for n, s in layout.logical.items()}
    for r, tensors in shards.items():
        for p in layout.ranks[r].pieces:
            full[p.logical][region(p.offsets, p.sizes)] = tensors[p.local][region(p.local_offsets, p.sizes)]
    return full


def _world(rank: int, world: int, port: int, sync_port: int, engine_tp: int, staged: bool, merge: bool,
           out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    groups = megatron_groups(TRAINER)
    engine_group = dist.new_group(list(range(2, world))) if engine_tp > 1 else None
    topo = Topology(SPEC, TRAINER, (EngineParallel(tp=engine_tp, dtype=SPEC.dtype),), views=views_of(None, LORA))
    rdv = Rendezvous("127.0.0.1", sync_port, world, "lora", timeout_s=60)
    ids = _batch()[0]
    if rank < 2:
        store = open_store(rdv, is_master=rank == 0)
        group = SyncGroup(rdv, rank, subgroups(topo), secret=SECRET, store=store)
        model = TrainerModel(SPEC, TRAINER, rank, groups.tp, groups.pp, source=_base(), optim=OPTIM, lora=LORA)
        model.load_adapter(_adapter())
        ep = Endpoint(topo, rank, group, 16 * 1024, tensors=model.adapter_tensors(), secret=SECRET)
        programs = {m: compile_path(m, ep) for m in set(MODES)}
        adapters, grads = [], []
        for version, mode in enumerate(MODES, start=1):
            if version > 1:
                grads.append(_train(model))
            programs[mode].run(model.adapter_tensors(), UpdateArgs(version=version))
            adapters.append({n: t.detach().clone() for n, t in model.adapter_tensors().items()})
        group.close()
        out.put((rank, {"adapters": adapters, "grads": grads, "frozen": all(not p.requires_grad for n, p in model.named_parameters()
                                                             if not n.startswith("adapter."))}))
        return
    tp_rank = rank - 2
    engine = EngineModel(SPEC, tp_rank, engine_tp, engine_group, lora=LORA, lora_merge=merge)
    engine.load_source(_base())
    base = {n: p.clone() for n, p in engine.named_parameters() if not n.startswith("adapter.")}
    dest = destination_of(engine, tp_rank, SHARD if staged else 0)
    receiver = Receiver(SPEC, tp_rank, engine_tp, dest, dtype=torch.float32, secret=SECRET, views=views_of(None, LORA))
    req = connect_request(topo, 0, {m.value: topo.fingerprint(m.value) for m in set(MODES)}, rdv,
                          bucket_bytes=16 * 1024, credits=2, ipc=None, control="store")
    receiver.join(req)
    got = []
    for version, mode in enumerate(MODES, start=1):
        stats = receiver.receive(mode, UpdateArgs(version=version))
        served = dest.served()
        params = dict(engine.named_parameters())
        got.append({"bytes": stats.bytes_received, "logits": engine.forward(ids).detach(),
                    "adapter": {n: t.detach().clone() for n, t in served.items()},
                    "base_kept": all(torch.equal(params[n], base[n]) for n in base),
                    "base": {n: params[n].detach().clone() for n in base} if merge else {},
                    "checksums": receiver.checksums()})
    receiver.leave()
    out.put((rank, got))


MERGE_ATOL = 2e-8  # float32 weights of ~0.1: a few ulps (the rank-8 sum's order, the final rounding)


def _merge_error(engine_tp: int, rank: int, base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor]) -> float:
    """max |merged base shard - (W + scale * B @ A) of the full tensors| over the rank's pieces."""
    from shardsync.layout import engine_layout

    source = _base()
    lay = engine_layout(SPEC, EngineParallel(tp=engine_tp, dtype=SPEC.dtype))
    worst = 0.0
    for p in lay.ranks[rank].pieces:
        module = p.logical.removesuffix(".weight")
        if module + ".lora_A.weight" not in adapter:
            continue
        full = source(p.logical) + LORA.scale * (adapter[module + ".lora_B.weight"] @ adapter[module + ".lora_A.weight"])
        diff = base[p.local][region(p.local_offsets, p.sizes)] - full[region(p.offsets, p.sizes)]
        worst = max(worst, float(diff.abs().max()))
    return worst


@pytest.fixture(scope="module")
def tp1_grads() -> dict[str, torch.Tensor]:
    """The TP 1 trainer's adapter gradients (HF names) of the first step."""
    par = MegatronParallel(dtype="float32")
    model = TrainerModel(SPEC, par, source=_base(), optim=OPTIM, lora=LORA)
    model.load_adapter(_adapter())
    return _merge(megatron_adapter_layout(SPEC, LORA, par), {0: _train(model)})


@torch.no_grad()
def _peft_logits(adapter: dict[str, torch.Tensor]) -> torch.Tensor:
    return peft_model(SPEC, _base(), LORA, adapter)(_batch()[0]).logits.float()


@pytest.mark.parametrize("engine_tp,staged,merge", [(1, False, False), (2, True, False), (2, True, True)],
                         ids=["e1-in-place", "e2-staged", "e2-staged-merge"])
def test_adapter_sync_moves_only_the_adapter(engine_tp: int, staged: bool, merge: bool, tp1_grads) -> None:
    """``merge``: the engine serves base + scale * B @ A, merged by each rank into its own base
    shard (fused QKV and gate/up rows included) from the base it loaded: within float32 rounding
    of the merge computed from the full tensors."""
    world = 2 + engine_tp
    res = run_world(_world, world, args=(world, free_port(), free_port(), engine_tp, staged, merge), timeout=240)
    trainer_layout = megatron_adapter_layout(SPEC, LORA, TRAINER)
    engine_lay = engine_adapter_layout(SPEC, LORA, EngineParallel(tp=engine_tp, dtype=SPEC.dtype))
    assert all(res[r]["frozen"] for r in range(2))
    adapter_bytes = sum(math.prod(s) for s in adapter_tensors(SPEC, LORA).values()) * 4
    # the TP 2 trainer's adapter gradients are the TP 1 one's (replicated halves summed over TP)
    grads = _merge(trainer_layout, {r: res[r]["grads"][0] for r in range(2)})
    assert max(rel(grads[n], tp1_grads[n]) for n in grads) < 1e-5
    for v in range(len(MODES)):
        trained = _merge(trainer_layout, {r: res[r]["adapters"][v] for r in range(2)})
        if v:  # a step moved every adapter tensor
            before = _merge(trainer_layout, {r: res[r]["adapters"][v - 1] for r in range(2)})
            assert all(not torch.equal(trained[n], before[n]) for n in trained), v
        served = _merge(engine_lay, {r: res[2 + r][v]["adapter"] for r in range(engine_tp)})
        assert all(torch.equal(served[n], trained[n]) for n in trained), v  # bitwise
        reference = _peft_logits(trained)
        for r in range(engine_tp):
            got = res[2 + r][v]
            assert got["base_kept"] is not merge, (v, r)
            assert min(got["checksums"].values()) >= 0, (v, r)  # nothing stale
            if merge:
                assert _merge_error(engine_tp, r, got["base"], trained) <= MERGE_ATOL, (v, r)
            assert rel(got["logits"][..., :SPEC.vocab_size], reference) < 1e-5, (v, r)
            # an engine rank's share of the adapter, and not a byte of the base
            share = sum(math.prod(t.shape) for t in engine_lay.ranks[r].tensors) * 4
            assert got["bytes"] == share if MODES[v] is Mode.P2P else got["bytes"] >= share, (v, got["bytes"])
            assert got["bytes"] <= adapter_bytes, (v, got["bytes"])
