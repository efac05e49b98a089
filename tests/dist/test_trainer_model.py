"""The reference trainer against ``transformers`` (TP 1, in-process) and against its own TP 1
run (TP/PP/DP > 1, one spawned gloo world of 4 ranks).

The world is spawned once (module fixture) and runs every parallel case in phases; models
of one phase live on disjoint rank sets.  Ranks compare their own gradients and post-step
shards against a TP 1 reference mapped into their layout (``load_rank`` of the reference's
HF-coordinate tensors), so only small results travel back; the tests below assert on them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.layout import Layout, MegatronParallel, megatron_layout
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.training import OptimConfig, grpo_loss
from shardsync.models.weights import load_rank, random_source
from shardsync.plan.local import region
from shardsync.spec import ModelSpec
from shardsync.presets import PRESETS
from tests.dist._compare import rel, to_hf, tp1_reference
from tests.dist._world import free_port, run_world

SPECS = ("tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-glm4")
TIED = tuple(s for s in SPECS if PRESETS[s].tie_word_embeddings)
SEED = 7
BATCH, SEQ = 4, 10
# eps well above the smallest gradients keeps Adam's first step a smooth function of the
# gradient, so TP-order rounding cannot flip an update's sign.
OPTIM = OptimConfig(lr=1e-3, eps=1e-5, max_grad_norm=1.0)
WORLD, WORLD_TIMEOUT_S = 4, 150
RTOL = 1e-5          # logits / logprobs / gradients: max|a-b| / max|b|
STEP_ATOL = 1e-2 * OPTIM.lr  # post-step parameters


@dataclass(frozen=True)
class Case:
    label: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    first_rank: int = 0
    specs: tuple[str, ...] = SPECS
    norm_names: str = "fused"
    bf16: bool = False

    @property
    def par(self) -> MegatronParallel:
        return MegatronParallel(tp=self.tp, pp=self.pp, dp=self.dp, norm_names=self.norm_names)

    def world_ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.par.world_size)


# Cases of one phase run at the same time on disjoint ranks of the 4-rank world.
PHASES = [
    [Case("tp2", tp=2), Case("pp2", pp=2, first_rank=2)],
    [Case("tp2pp2", tp=2, pp=2)],
    [Case("tp2dp2", tp=2, dp=2)],
    [Case("pp2dp2-separate", pp=2, dp=2, norm_names="separate")],
    [Case("pp4", pp=4)],
    [Case("tp4", tp=4, specs=("tiny-llama",))],  # the only preset with 4 kv heads
    [Case("bf16-tp2pp2", tp=2, pp=2, specs=("tiny-qwen3",), bf16=True)],
]
CASES = [c for phase in PHASES for c in phase]


def _batch(grpo: dict[str, torch.Tensor], dp_rank: int, dp: int) -> tuple[torch.Tensor, Callable]:
    """DP replica ``dp_rank``'s rows and its GRPO loss."""
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    loss_fn = functools.partial(grpo_loss, old_logprobs=grpo["old"][rows],
                                advantages=grpo["adv"][rows], mask=grpo["mask"][rows])
    return grpo["ids"][rows], loss_fn


def _reference(spec: ModelSpec, grpo: dict[str, torch.Tensor], dp: int = 1) -> dict[str, Any]:
    """TP 1 / PP 1 trainer doing what a DP ``dp`` world does: mean of the replicas' losses."""
    return tp1_reference(spec, lambda d, n: _batch(grpo, d, n), dp, seed=SEED, optim=OPTIM)


# --- what every rank of the world computes ---------------------------------------------------


def _run_case(case: Case, name: str, rank: int, groups: Any, grpo: dict[str, torch.Tensor],
              refs: dict[tuple[str, int], dict[str, Any]]) -> dict[str, Any]:
    spec, par = PRESETS[name], case.par
    dtype = torch.bfloat16 if case.bf16 else torch.float32
    model = TrainerModel(spec, par, rank, groups.tp, groups.pp, dp_group=groups.dp,
                         source=random_source(spec, SEED), compute_dtype=dtype, optim=OPTIM,
                         timeout_s=60)
    out: dict[str, Any] = {
        "params": [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
        "logits": model.logits(grpo["ids"]),
        "logprobs": model.policy_logprobs(grpo["ids"]),
    }
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, dp_rank, _ = par.coords(rank)
    ids, loss_fn = _batch(grpo, dp_rank, par.dp)
    out["loss"] = model.forward_backward(ids, loss_fn)
    model.finish_grad_sync()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out["grad_norm"] = model.optimizer_step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["changed"] = {n: not torch.equal(before[n], after[n]) for n in after}
    out["grad_nonzero"] = {n: bool(g.any()) for n, g in grads.items()}
    if model.tied_copy:
        copy = "embedding.word_embeddings.weight" if model.first else "output_layer.weight"
        out["tied_before"], out["tied"] = before[copy], after[copy]
    if not case.bf16:
        key = (name, par.dp)
        if key not in refs:
            refs[key] = _reference(spec, grpo, par.dp)
        ref = refs[key]
        want_grads = load_rank(model.layout, rank, ref["grads"].__getitem__)
        want_params = load_rank(model.layout, rank, ref["params"].__getitem__)
        out["loss_ref"] = ref["losses"][dp_rank]
        out["norm_ref"] = ref["norm"]
        out["grad_err"] = {n: rel(grads[n], want_grads[n]) for n in grads}
        out["step_err"] = {n: float((after[n] - want_params[n]).abs().max()) for n in after}
    return out


def _world_checks(rank: int, world: int, inputs: dict[str, dict[str, torch.Tensor]]) -> dict:
    out: dict[Any, Any] = {}
    refs: dict[tuple[str, int], dict[str, Any]] = {}
    for phase in PHASES:
        # Every process creates every group of the phase, in the same order.
        made = [(case, megatron_groups(case.par, first_rank=case.first_rank, timeout_s=60))
                for case in phase]
        for case, groups in made:
            if groups.rank is not None:
                for name in case.specs:
                    out[case.label, name] = _run_case(case, name, groups.rank, groups,
                                                      inputs[name], refs)
    return out


# --- spawned gloo world -----------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        out.put((rank, fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def _run_world(world: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; their results by rank."""
    got = run_world(_worker, world, args=(world, free_port(), fn, args), timeout=WORLD_TIMEOUT_S)
    return [got[r] for r in range(world)]


# --- transformers reference -------------------------------------------------------------------


def _hf_model(spec: ModelSpec, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=dtype)
    source = random_source(spec, SEED)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is not listed
            param.copy_(source(name).to(dtype))
    return model


def _hf_reference(spec: ModelSpec) -> dict[str, Any]:
    """transformers' logits, logprobs, GRPO inputs, loss, gradients and one AdamW step."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=g)
    hf = _hf_model(spec)
    logits = hf(ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    old = lp.detach() + 0.3 * torch.randn(lp.shape, generator=g)  # some ratios get clipped
    grpo = {"ids": ids, "old": old, "adv": torch.randn(BATCH, generator=g),
            "mask": (torch.rand(lp.shape, generator=g) > 0.2).float()}
    loss = grpo_loss(lp, old_logprobs=grpo["old"], advantages=grpo["adv"], mask=grpo["mask"])
    loss.backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    # float64: torch's fp32 norm of ~3M elements is only good to ~1e-5.
    norm = float(sum(g.double().pow(2).sum() for g in grads.values()).sqrt())
    torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM.max_grad_norm)
    torch.optim.AdamW(hf.parameters(), lr=OPTIM.lr, betas=OPTIM.betas, eps=OPTIM.eps,
                      weight_decay=0.0).step()
    return {"grpo": grpo, "logits": logits.detach(), "logprobs": lp.detach(),
            "loss": loss.item(), "grads": grads, "norm": norm,
            "params": {n: p.detach().clone() for n, p in hf.named_parameters()}}


@pytest.fixture(scope="module")
def hf_ref() -> dict[str, dict[str, Any]]:
    return {name: _hf_reference(PRESETS[name]) for name in SPECS}


@pytest.fixture(scope="module")
def world(hf_ref: dict[str, dict[str, Any]]) -> list[dict[Any, Any]]:
    return _run_world(WORLD, _world_checks, {name: ref["grpo"] for name, ref in hf_ref.items()})


def _results(world: list[dict[Any, Any]], case: Case, name: str) -> list[tuple[int, dict]]:
    """(model rank, result) of every rank of ``case``'s model."""
    return [(r - case.first_rank, world[r][case.label, name]) for r in case.world_ranks()]


def _fp32_results(world: list[dict[Any, Any]]):
    for case in CASES:
        if not case.bf16:
            for name in case.specs:
                for rank, res in _results(world, case, name):
                    yield case, name, rank, res


# --- tests ------------------------------------------------------------------------------------


def test_tp1_matches_transformers(hf_ref):
    torch.set_num_threads(1)
    for name in SPECS:
        spec, want = PRESETS[name], hf_ref[name]
        ref = _reference(spec, want["grpo"])
        model: TrainerModel = ref["model"]
        fresh = TrainerModel(spec, MegatronParallel(), source=random_source(spec, SEED))
        assert rel(fresh.logits(want["grpo"]["ids"]), want["logits"]) <= RTOL, name
        assert rel(fresh.policy_logprobs(want["grpo"]["ids"]), want["logprobs"]) <= RTOL, name
        assert ref["losses"][0] == pytest.approx(want["loss"], rel=1e-6), name
        assert ref["norm"] == pytest.approx(want["norm"], rel=1e-6), name
        assert ref["grads"].keys() == want["grads"].keys()
        for key, grad in want["grads"].items():
            assert rel(ref["grads"][key], grad) <= RTOL, (name, key)
            assert (ref["params"][key] - want["params"][key]).abs().max() <= STEP_ATOL, (name, key)
        assert [n for n, _ in model.named_parameters()] == [
            t.name for t in megatron_layout(spec, MegatronParallel()).ranks[0].tensors]


def test_parameters_are_the_megatron_layout(world):
    for case in CASES:
        for name in case.specs:
            layout = megatron_layout(PRESETS[name], case.par)
            for rank, res in _results(world, case, name):
                want = [(t.name, t.shape, torch.float32) for t in layout.ranks[rank].tensors]
                assert res["params"] == want, (case.label, name, rank)


def test_logits_and_logprobs_match_transformers(world, hf_ref):
    for case, name, rank, res in _fp32_results(world):
        where = (case.label, name, rank)
        assert rel(res["logits"], hf_ref[name]["logits"]) <= RTOL, where
        assert rel(res["logprobs"], hf_ref[name]["logprobs"]) <= RTOL, where


def test_loss_gradients_and_norm_match_tp1(world):
    for case, name, rank, res in _fp32_results(world):
        where = (case.label, name, rank)
        assert res["loss"] == pytest.approx(res["loss_ref"], rel=1e-5), where
        assert res["grad_norm"] == pytest.approx(res["norm_ref"], rel=1e-6), where
        worst = max(res["grad_err"], key=res["grad_err"].get)
        assert res["grad_err"][worst] <= RTOL, (*where, worst, res["grad_err"][worst])


def test_one_step_changes_every_tensor_and_matches_tp1(world):
    for case, name, rank, res in _fp32_results(world):
        where = (case.label, name, rank)
        # An embedding shard may hold no token of the batch (tp4: 48 real rows on rank 3).
        same = [n for n, c in res["changed"].items() if not c]
        assert all(n == "embedding.word_embeddings.weight" and not res["grad_nonzero"][n]
                   for n in same), (where, same)
        worst = max(res["step_err"], key=res["step_err"].get)
        assert res["step_err"][worst] <= STEP_ATOL, (*where, worst, res["step_err"][worst])


def test_tied_embedding_copies_stay_bitwise_equal(world):
    checked = 0
    for case in CASES:
        if case.pp == 1:
            continue
        par = case.par
        for name in set(case.specs) & set(TIED):
            res = dict(_results(world, case, name))
            for dp_rank in range(par.dp):
                for tp_rank in range(par.tp):
                    first = res[par.rank(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=0)]
                    last = res[par.rank(tp_rank=tp_rank, dp_rank=dp_rank, pp_rank=par.pp - 1)]
                    assert torch.equal(first["tied_before"], last["tied_before"])
                    assert not torch.equal(first["tied"], first["tied_before"])
                    assert torch.equal(first["tied"], last["tied"]), (case.label, name, tp_rank)
                    checked += 1
    assert checked >= 10


def test_dp_replicas_agree(world):
    for case in CASES:
        if case.dp == 1:
            continue
        for name in case.specs:
            res = dict(_results(world, case, name))
            for rank, r in res.items():
                pp_rank, dp_rank, tp_rank = case.par.coords(rank)
                twin = res[case.par.rank(tp_rank=tp_rank, dp_rank=1 - dp_rank, pp_rank=pp_rank)]
                assert r["grad_norm"] == twin["grad_norm"]
                assert r["step_err"] == twin["step_err"]  # same shards after the step


def test_bf16_compute_close_to_transformers_bf16(world, hf_ref):
    case = next(c for c in CASES if c.bf16)
    (name,) = case.specs
    with torch.no_grad():
        expected = _hf_model(PRESETS[name], torch.bfloat16)(hf_ref[name]["grpo"]["ids"]).logits
    for _, res in _results(world, case, name):
        assert all(dtype == torch.float32 for _, _, dtype in res["params"])  # master weights
        assert rel(res["logits"], expected.float()) <= 2e-2
        assert torch.isfinite(torch.tensor(res["loss"])) and res["grad_norm"] > 0
        assert all(res["changed"].values())


def test_grpo_loss():
    lp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = grpo_loss(lp, old_logprobs=torch.zeros(2, 3), advantages=adv, mask=mask)
    assert loss.item() == pytest.approx(-(1 + 1 - 2) / 3)
    # ratio above 1 + clip with a positive advantage: clipped, no gradient.
    lp = torch.full((1, 2), 0.5, requires_grad=True)
    grpo_loss(lp, old_logprobs=torch.zeros(1, 2), advantages=torch.ones(1),
              mask=torch.ones(1, 2)).backward()
    assert torch.equal(lp.grad, torch.zeros(1, 2))


def test_user_errors():
    spec = PRESETS["tiny-qwen2"]  # 2 kv heads
    with pytest.raises(ValueError, match="Case A"):
        TrainerModel(spec, MegatronParallel(tp=4), 0)
    with pytest.raises(ValueError, match="tp_group"):
        TrainerModel(spec, MegatronParallel(tp=2), 0)
    with pytest.raises(ValueError, match="pp_group"):
        TrainerModel(spec, MegatronParallel(pp=2), 1)
    with pytest.raises(ValueError, match="compute_dtype"):
        TrainerModel(spec, MegatronParallel(), compute_dtype=torch.float16)
    model = TrainerModel(spec, MegatronParallel())
    with pytest.raises(ValueError, match="token ids"):
        model.policy_logprobs(torch.tensor([[1, spec.vocab_size]]))
    with pytest.raises(ValueError, match="seq >= 2"):
        model.policy_logprobs(torch.tensor([[1]]))
    with pytest.raises(ValueError, match="scalar"):
        model.forward_backward(torch.tensor([[1, 2, 3]]), lambda lp: lp)
