"""Mixture-of-experts reference models: the trainer and engine at TP/EP 1 against
``transformers`` (``Qwen3MoeForCausalLM``, ``Glm4MoeForCausalLM``, in process), then every
expert-parallel world against that TP 1 run (one spawned 4-rank gloo world, run in phases).

Trainer worlds cover EP over DP, EP over TP, expert TP, both expert spellings and PP; each
rank checks its logits, its DP batch's loss, its gradients after the (expert-)DP reduction
and its post-step shards against the TP 1 trainer mapped into its layout.  Engine worlds
cover TP with EP 1, 2 and 4; their logits must equal the TP 1 engine's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.layout import Layout, MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.training import OptimConfig, grpo_loss
from shardsync.models.weights import TensorSource, load_rank, random_source
from shardsync.plan.local import region
from shardsync.spec import ModelSpec
from shardsync.presets import PRESETS
from tests.dist._compare import rel, to_hf, tp1_reference
from tests.dist._world import free_port, run_world

SPECS = ("tiny-qwen3-moe", "tiny-glm4-moe")
SEED, BATCH, SEQ = 3, 4, 12
OPTIM = OptimConfig(lr=1e-3, eps=1e-5, max_grad_norm=1.0)
RTOL = 1e-5
STEP_ATOL = 1e-2 * OPTIM.lr
WORLD, WORLD_TIMEOUT_S = 4, 240


@dataclass(frozen=True)
class TrainerCase:
    label: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int | None = None
    expert_names: str = "sequential"
    norm_names: str = "fused"
    specs: tuple[str, ...] = SPECS

    @property
    def par(self) -> MegatronParallel:
        return MegatronParallel(tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, etp=self.etp,
                                expert_names=self.expert_names, norm_names=self.norm_names)


TRAINER_CASES = [
    TrainerCase("tp1-dp2-ep2", dp=2, ep=2, specs=SPECS[:1]),
    TrainerCase("tp2-etp2", tp=2, specs=SPECS[:1]),
    TrainerCase("tp2-ep2-etp1-grouped", tp=2, ep=2, etp=1, expert_names="grouped"),
    TrainerCase("tp2-etp1-edp2", tp=2, etp=1, norm_names="separate", specs=SPECS[:1]),
    TrainerCase("tp2-dp2-ep2-etp1", tp=2, dp=2, ep=2, etp=1, specs=SPECS[:1]),
    TrainerCase("tp1-dp4-ep4", dp=4, ep=4),
    TrainerCase("pp2-dp2-ep2", pp=2, dp=2, ep=2),
]
ENGINE_CASES = [(2, 1, SPECS), (2, 2, SPECS[:1]), (4, 2, SPECS), (4, 4, SPECS[:1])]  # (tp, ep, specs)


def _inputs(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    return {"ids": ids, "old": -3.0 + 0.1 * torch.randn(BATCH, SEQ - 1, generator=g),
            "adv": torch.randn(BATCH, generator=g), "mask": torch.rand(BATCH, SEQ - 1, generator=g) > 0.2}


def _batch(inp: dict[str, torch.Tensor], dp_rank: int, dp: int):
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    return inp["ids"][rows], functools.partial(grpo_loss, old_logprobs=inp["old"][rows],
                                               advantages=inp["adv"][rows], mask=inp["mask"][rows])


def _reference(spec: ModelSpec, inp: dict[str, torch.Tensor], dp: int) -> dict[str, Any]:
    return tp1_reference(spec, lambda d, n: _batch(inp, d, n), dp, seed=SEED, optim=OPTIM)


# --- transformers (in process) ----------------------------------------------------------------


def _hf_model(spec: ModelSpec, source: TensorSource | None = None):
    """transformers' model from the same random source (or ``source``; experts stacked as it holds them)."""
    import transformers

    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32)
    src = source or random_source(spec, SEED)
    E = spec.num_experts
    with torch.no_grad():  # GLM4-MoE's e_score_correction_bias is a buffer there
        for name, param in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if "e_score" in n)]:
            pre = name.split("experts.")[0]
            if name.endswith("experts.gate_up_proj"):
                t = torch.stack([torch.cat([src(f"{pre}experts.{e}.gate_proj.weight"),
                                            src(f"{pre}experts.{e}.up_proj.weight")]) for e in range(E)])
            elif name.endswith("experts.down_proj"):
                t = torch.stack([src(f"{pre}experts.{e}.down_proj.weight") for e in range(E)])
            else:
                t = src(name)
            param.copy_(t)
    return model


def _hf_grads(spec: ModelSpec, model) -> dict[str, torch.Tensor]:
    """transformers' gradients under shardsync's logical (per-expert) names."""
    out = {}
    F = spec.moe_intermediate_size
    for name, p in model.named_parameters():
        pre = name.split("experts.")[0]
        if name.endswith("experts.gate_up_proj"):
            for e in range(spec.num_experts):
                out[f"{pre}experts.{e}.gate_proj.weight"] = p.grad[e, :F]
                out[f"{pre}experts.{e}.up_proj.weight"] = p.grad[e, F:]
        elif name.endswith("experts.down_proj"):
            for e in range(spec.num_experts):
                out[f"{pre}experts.{e}.down_proj.weight"] = p.grad[e]
        elif not (name == "lm_head.weight" and spec.tie_word_embeddings):
            out[name] = p.grad
    return out


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("expert_names", ["sequential", "grouped"])
def test_trainer_matches_transformers(name: str, expert_names: str) -> None:
    spec = PRESETS[name]
    inp = _inputs(spec)
    hf = _hf_model(spec)
    ids, loss_fn = _batch(inp, 0, 1)
    logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_fn(logp).backward()
    want = _hf_grads(spec, hf)
    model = TrainerModel(spec, MegatronParallel(expert_names=expert_names), source=random_source(spec, SEED))
    assert rel(model.logits(ids), hf(ids).logits) <= RTOL
    model.forward_backward(ids, loss_fn)
    model.finish_grad_sync()
    got = to_hf(model.layout, 0, {n: p.grad for n, p in model.named_parameters()})
    # every parameter of transformers; a buffer there (GLM4-MoE's correction bias) has no gradient here
    assert set(want) <= set(got) and all(not got[n].any() for n in set(got) - set(want))
    errs = {n: rel(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    routed = [n for n in want if ".experts." in n and want[n].abs().max() > 0]
    assert len(routed) > spec.num_experts, "the batch routed tokens to too few experts to test"


@pytest.mark.parametrize("name", SPECS)
def test_engine_matches_transformers(name: str) -> None:
    spec = PRESETS[name]
    ids = _inputs(spec)["ids"]
    hf = _hf_model(spec)
    engine = EngineModel.from_source(spec, random_source(spec, SEED))
    assert rel(engine(ids), hf(ids).logits) <= RTOL


# --- the parallel worlds ----------------------------------------------------------------------


def assert_trainer_world(world, case: TrainerCase, name: str, rtol: float) -> None:
    """Every rank of a trainer world against the TP 1 run: logits, loss, every gradient, the grad
    norm and the optimizer step (the latent and sparse attention tests share it)."""
    for r in range(case.par.world_size):
        got = world[r][case.label, name]
        assert got["logits"] <= rtol and got["loss"] <= 1e-5, (r, got["logits"], got["loss"])
        worst = max(got["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, (r, worst)
        assert got["norm"] <= 1e-5 and got["step"] <= STEP_ATOL, (r, got["norm"], got["step"])


def _trainer_case(spec: ModelSpec, case: TrainerCase, groups, inp, refs) -> dict[str, Any]:
    par, rank = case.par, groups.rank
    model = TrainerModel(spec, par, rank, groups.tp, groups.pp, dp_group=groups.dp, expert_group=groups.expert,
                         expert_dp_group=groups.expert_dp, source=random_source(spec, SEED), optim=OPTIM)
    if (spec.name, par.dp) not in refs:
        refs[spec.name, par.dp] = _reference(spec, inp, par.dp)
    ref = refs[spec.name, par.dp]
    _, dp_rank, _ = par.coords(rank)
    out: dict[str, Any] = {"logits": rel(model.logits(inp["ids"]), ref["logits"])}
    ids, loss_fn = _batch(inp, dp_rank, par.dp)
    out["loss"] = abs(model.forward_backward(ids, loss_fn) - ref["losses"][dp_rank])
    model.finish_grad_sync()
    want = load_rank(model.layout, rank, ref["grads"].__getitem__)
    out["grads"] = {n: rel(p.grad, want[n]) for n, p in model.named_parameters() if want[n].abs().max() > 0}
    out["norm"] = abs(model.optimizer_step() - ref["norm"]) / ref["norm"]
    want = load_rank(model.layout, rank, ref["params"].__getitem__)
    out["step"] = max(float((p.detach() - want[n]).abs().max()) for n, p in model.named_parameters())
    return out


def _world(rank: int, world: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    refs, results = {}, {}
    inputs = {n: _inputs(PRESETS[n]) for n in SPECS}
    try:
        for case in TRAINER_CASES:
            groups = megatron_groups(case.par, timeout_s=60, moe=True)
            for name in case.specs:
                if groups.rank is not None:
                    results[case.label, name] = _trainer_case(PRESETS[name], case, groups, inputs[name], refs)
        wants = {n: EngineModel.from_source(PRESETS[n], random_source(PRESETS[n], SEED))(inputs[n]["ids"])
                 for n in SPECS}
        for tp, ep, names in ENGINE_CASES:
            group = dist.new_group(list(range(tp)))
            for name in names:
                if rank < tp:
                    spec = PRESETS[name]
                    engine = EngineModel.from_source(spec, random_source(spec, SEED), rank, tp, group, ep=ep)
                    results[f"engine-tp{tp}-ep{ep}", name] = {"logits": rel(engine(inputs[name]["ids"]), wants[name])}
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world() -> dict[int, dict[str, Any]]:
    return run_world(_world, WORLD, args=(WORLD, free_port()), timeout=WORLD_TIMEOUT_S)


@pytest.mark.parametrize(("case", "name"), [(c, n) for c in TRAINER_CASES for n in c.specs],
                         ids=lambda x: x.label if isinstance(x, TrainerCase) else x)
def test_expert_parallel_trainer_matches_tp1(world, case: TrainerCase, name: str) -> None:
    for r in range(case.par.world_size):
        got = world[r][case.label, name]
        assert got["logits"] <= RTOL, (r, got["logits"])
        assert got["loss"] <= 1e-5, (r, got["loss"])
        worst = max(got["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-4, (r, worst)
        assert got["norm"] <= 1e-5, (r, got["norm"])
        assert got["step"] <= STEP_ATOL, (r, got["step"])


@pytest.mark.parametrize(("tp", "ep", "name"), [(tp, ep, n) for tp, ep, names in ENGINE_CASES for n in names])
def test_expert_parallel_engine_matches_tp1(world, tp: int, ep: int, name: str) -> None:
    for r in range(tp):
        assert world[r][f"engine-tp{tp}-ep{ep}", name]["logits"] <= RTOL


def _biased(spec: ModelSpec):
    """GLM4-MoE weights whose correction bias sends every token to experts 0-3 (EP rank 0 of 2)."""
    src = random_source(spec, SEED)

    def get(name: str) -> torch.Tensor:
        t = src(name)
        if name.endswith("e_score_correction_bias"):
            t = t.clone()
            t[: spec.num_experts // 2] += 10.0
        return t
    return get


def _idle_rank_world(rank: int, world: int, port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        spec = PRESETS["tiny-glm4-moe"]
        par = MegatronParallel(tp=2, ep=2, etp=1)
        groups = megatron_groups(par, timeout_s=30, moe=True)
        inp = _inputs(spec)
        ids, loss_fn = _batch(inp, 0, 1)
        model = TrainerModel(spec, par, rank, groups.tp, groups.pp, dp_group=groups.dp, expert_group=groups.expert,
                             expert_dp_group=groups.expert_dp, source=_biased(spec), timeout_s=30)
        model.forward_backward(ids, loss_fn)  # rank 1's experts see no token: it must not skip the exchange
        model.finish_grad_sync()
        ref = TrainerModel(spec, MegatronParallel(), source=_biased(spec))
        ref.forward_backward(ids, loss_fn)
        ref.finish_grad_sync()
        want = load_rank(model.layout, rank, to_hf(ref.layout, 0, {n: p.grad for n, p in ref.named_parameters()}).__getitem__)
        idle = [n for n, p in model.named_parameters() if ".experts." in n and not p.grad.any()]
        out.put((rank, {"idle": len(idle), "err": max(rel(p.grad, want[n]) for n, p in model.named_parameters()
                                                      if want[n].abs().max() > 0)}))
    finally:
        dist.destroy_process_group()


def test_expert_parallel_rank_without_tokens_still_exchanges() -> None:
    got = run_world(_idle_rank_world, 2, args=(2, free_port()), timeout=120)
    assert got[1]["idle"] > 0 and got[0]["idle"] == 0  # rank 1's experts really got nothing
    assert max(g["err"] for g in got.values()) <= 1e-4


@pytest.mark.parametrize("name", SPECS)
def test_bf16_trainer_stays_in_bf16(name: str) -> None:
    """An fp32 router (GLM4-MoE) beside bf16 activations: the layer hands bf16 on, forward and back."""
    spec = PRESETS[name]
    inp = _inputs(spec)
    ids, loss_fn = _batch(inp, 0, 1)
    fp32 = TrainerModel(spec, MegatronParallel(), source=random_source(spec, SEED))
    bf16 = TrainerModel(spec, MegatronParallel(), source=random_source(spec, SEED), compute_dtype=torch.bfloat16)
    assert rel(bf16.logits(ids), fp32.logits(ids)) <= 5e-2
    assert abs(bf16.forward_backward(ids, loss_fn) - fp32.forward_backward(ids, loss_fn)) <= 5e-2
