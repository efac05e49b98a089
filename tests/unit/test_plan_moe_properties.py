"""Property tests for mixture-of-experts (Qwen3-MoE, GLM4-MoE) layouts and plans.

The dense property tests (``test_plan_properties``) extended to experts: random small MoE
specs, random valid Megatron (tp, pp, dp, ep, etp, expert spelling, norm spelling) and
SGLang (tp, ep) configs.  Trainer shards come from the independent Megatron rule in
``reference_rules`` (narrow/cat of full HF tensors filled with distinct integer ids); the
plans shardsync derives are executed in memory and must give, bitwise, what the reference
SGLang loader builds (its 3-D ``w13_weight``/``w2_weight`` viewed as the layout's 2-D shapes).
The validity rules used to draw configs are written here from LAYOUTS.md, not taken from
the layouts, and configs outside them must be refused with a ``ValueError`` naming the rule.
GLM4-MoE specs (first k layers dense, sigmoid router with its correction bias and valid expert
groups, shared experts on or off, attention bias and q/k norms at random) run through every
property alongside Qwen3-MoE.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardsync.layout import (
    EngineParallel,
    MegatronParallel,
    engine_layout,
    full_layout,
    logical_tensors,
    megatron_layout,
)
from shardsync.plan import build_plan, execute_local
from shardsync.presets import PRESETS
from shardsync.spec import ModelSpec
from shardsync.topology import Topology
from tests.unit.reference_rules import (
    CORRECTION_BIAS,
    engine_shards,
    hf_shapes,
    is_sparse,
    megatron_expert_rank,
    megatron_shards,
    qk_norm,
    qkv_bias,
    shared_size,
    stage_sizes,
    synthetic_full,
)
from tests.unit.test_plan_properties import (
    MEGATRON_PAD,
    assert_shards_equal,
    check_gather,
    check_plan_covers,
    pick_tp,
)

PROPS = settings(max_examples=30, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(PROPS, max_examples=20)

Shards = list[dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------
# Validity rules (LAYOUTS.md §2, §4, §5, §8; Megatron's and SGLang's own divisibility asserts)
# ---------------------------------------------------------------------------------------

# Each rule: (what it says, words the refusal message must contain to name it).
HEADS = ("num_heads divisible by tp", ("num_heads",))
KV = ("tp divides or is a multiple of num_kv_heads", ("num_kv_heads",))
QKV_ROWS = ("fused QKV rows divisible by tp", ("QKV",))
DENSE_FFN = ("intermediate_size divisible by tp (dense layers only)", ("intermediate_size",))
PP_SPLIT = ("layers split over pp", ("pp", "num_layers"))
EXPERT_GRID = ("etp*ep divides tp*dp", ("etp", "ep", "tp", "dp"))
EXPERTS_EP = ("num_experts divisible by ep", ("num_experts", "ep"))
MOE_FFN_ETP = ("moe_intermediate_size divisible by etp", ("moe_intermediate_size", "etp"))
ENGINE_EP_TP = ("ep divides tp", ("ep", "tp"))
MOE_FFN_MOE_TP = ("moe_intermediate_size divisible by tp/ep", ("moe_intermediate_size",))
# GLM4-MoE: shared experts are a dense MLP over the attention TP (trainer tp, engine tp).
SHARED_FFN = ("shared_expert_intermediate_size divisible by tp", ("shared_expert_intermediate_size", "tp"))


def names_rule(message: str, rule) -> bool:
    """Whether ``message`` contains every word of ``rule`` as a whole identifier."""
    return all(re.search(rf"(?<![A-Za-z_]){re.escape(w)}(?![A-Za-z_])", message) for w in rule[1])


def has_dense_layers(spec: ModelSpec) -> bool:
    return any(not is_sparse(spec, n) for n in range(spec.num_layers))


def attention_violations(spec: ModelSpec, tp: int, *, megatron: bool) -> list:
    h, ng, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = []
    if h % tp:
        out.append(HEADS)
    if ng % tp and tp % ng:
        out.append(KV)
    if megatron and ((h + 2 * ng) * d) % tp:
        out.append(QKV_ROWS)
    if has_dense_layers(spec) and spec.intermediate_size % tp:
        out.append(DENSE_FFN)
    return out


def tp_violations(spec: ModelSpec, tp: int, *, megatron: bool) -> list:
    """Every rule on the (attention) TP size alone: attention, dense MLP, shared experts."""
    out = attention_violations(spec, tp, megatron=megatron)
    if shared_size(spec) % tp:
        out.append(SHARED_FFN)
    return out


def megatron_violations(spec: ModelSpec, tp: int, pp: int, dp: int, ep: int, etp: int | None,
                        pp_layers: tuple[int, ...] | None = None) -> list:
    etp = tp if etp is None else etp
    out = tp_violations(spec, tp, megatron=True)
    if pp_layers is None and spec.num_layers % pp:
        out.append(PP_SPLIT)
    if (tp * dp) % (etp * ep):
        out.append(EXPERT_GRID)
    if spec.num_experts % ep:
        out.append(EXPERTS_EP)
    if spec.moe_intermediate_size % etp:
        out.append(MOE_FFN_ETP)
    return out


def engine_violations(spec: ModelSpec, tp: int, ep: int) -> list:
    out = tp_violations(spec, tp, megatron=False)
    if tp % ep:
        out.append(ENGINE_EP_TP)
    if spec.num_experts % ep:
        out.append(EXPERTS_EP)
    if tp % ep == 0 and spec.moe_intermediate_size % (tp // ep):
        out.append(MOE_FFN_MOE_TP)
    return out


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

MOE_FAMILIES = ["qwen3_moe", "glm4_moe"]


@st.composite
def glm4_moe_fields(draw, layers: int, moe_ffn: int) -> dict:
    """GLM4-MoE's MoE config as HF ``Glm4MoeConfig`` spells it, drawn valid: ``n_group``
    divides the experts into groups of >= 2 (the router sums each group's top-2 scores),
    ``topk_group <= n_group``, top-k within the chosen groups' experts; the first
    ``first_k_dense_replace`` layers dense; ``n_shared_experts`` shared experts of
    ``moe_intermediate_size`` each (0: none)."""
    experts = draw(st.sampled_from([2, 4, 4, 6, 8, 8]))
    n_group = draw(st.sampled_from([g for g in range(1, experts + 1) if experts % g == 0 and experts // g >= 2]))
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, topk_group * (experts // n_group)))
    first_k_dense = draw(st.integers(0, min(layers - 1, 2)))
    n_shared = draw(st.sampled_from([0, 1, 1, 2]))
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_ffn,
                mlp_only_layers=tuple(range(first_k_dense)), router="sigmoid", n_group=n_group,
                topk_group=topk_group, routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                norm_topk_prob=draw(st.booleans()), shared_expert_intermediate_size=moe_ffn * n_shared,
                attention_bias=draw(st.booleans()), qk_layernorm=draw(st.booleans()),
                partial_rotary_factor=0.5)


@st.composite
def moe_specs(draw, families: list[str] = MOE_FAMILIES) -> ModelSpec:
    family = draw(st.sampled_from(families))
    ng = draw(st.sampled_from([1, 1, 2, 2, 4]))
    heads = ng * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4]))
    hidden = draw(st.integers(1, 8))
    ffn = draw(st.sampled_from([3, 4, 6, 8, 12]))  # 3: only all-sparse models split it over tp > 1
    vocab = draw(st.integers(1, 200))
    layers = draw(st.integers(1, 4))
    moe_ffn = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12]))
    tied = draw(st.booleans())
    if family == "glm4_moe":
        moe = draw(glm4_moe_fields(layers, moe_ffn))
        tag = (f"G{moe['n_group']}.{moe['topk_group']}S{moe['shared_expert_intermediate_size']}"
               f"{'b' if moe['attention_bias'] else ''}{'n' if moe['qk_layernorm'] else ''}")
    else:
        experts = draw(st.sampled_from([1, 2, 3, 4, 4, 6, 8, 8]))
        moe = dict(num_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)),
                   moe_intermediate_size=moe_ffn, decoder_sparse_step=draw(st.sampled_from([1, 1, 1, 2, 3])),
                   mlp_only_layers=tuple(sorted(draw(st.lists(st.integers(0, layers - 1), unique=True,
                                                              max_size=min(layers - 1, 2))))))
        tag = f"s{moe['decoder_sparse_step']}"
    name = (f"rand-{family}-h{heads}g{ng}d{head_dim}H{hidden}F{ffn}V{vocab}L{layers}E{moe['num_experts']}"
            f"k{moe['num_experts_per_tok']}I{moe_ffn}{tag}m{''.join(map(str, moe['mlp_only_layers']))}"
            f"{'t' if tied else 'u'}")
    return ModelSpec(name=name, family=family, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=ng, head_dim=head_dim, intermediate_size=ffn,
                     vocab_size=vocab, tie_word_embeddings=tied, dtype="float32", **moe)


@st.composite
def moe_trainers(draw, spec: ModelSpec, max_dp: int = 3) -> MegatronParallel:
    tp = pick_tp(draw, [t for t in range(1, 9) if not tp_violations(spec, t, megatron=True)])
    dp = draw(st.integers(1, max_dp))
    L = spec.num_layers
    pp = draw(st.integers(1, min(L, 3)))
    pp_layers = None
    if L % pp or draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, L), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, L]
        pp_layers = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    grid = [(ep, etp) for ep in range(1, 9) for etp in range(1, 9)
            if not megatron_violations(spec, tp, 1, dp, ep, etp)]
    if any(ep > 1 for ep, _ in grid) and draw(st.booleans()):
        grid = [g for g in grid if g[0] > 1]  # often expert parallel
    elif len(grid) > 1 and draw(st.integers(0, 3)):
        grid = grid[1:]  # mostly something other than ep = etp = 1
    ep, etp = draw(st.sampled_from(grid))
    return MegatronParallel(
        tp=tp, pp=pp, dp=dp, pp_layers=pp_layers, ep=ep,
        etp=None if etp == tp and draw(st.booleans()) else etp,  # None: Megatron's default etp = tp
        expert_names=draw(st.sampled_from(["sequential", "grouped"])),
        norm_names=draw(st.sampled_from(["fused", "separate"])),
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 2, 16, 128])),
    )


@st.composite
def moe_engines(draw, spec: ModelSpec) -> EngineParallel:
    options = {t: [ep for ep in range(1, t + 1) if not engine_violations(spec, t, ep)] for t in range(1, 9)}
    tp = pick_tp(draw, [t for t, eps in options.items() if eps])
    eps = options[tp]
    if len(eps) > 1 and draw(st.booleans()):
        eps = eps[1:]  # expert parallel
    return EngineParallel(tp=tp, ep=draw(st.sampled_from(eps)))


@dataclass(frozen=True)
class MoECase:
    spec: ModelSpec
    trainer: MegatronParallel
    engines: tuple[EngineParallel, ...]

    @property
    def topology(self) -> Topology:
        return Topology(self.spec, self.trainer, self.engines)


@st.composite
def moe_cases(draw, max_dp: int = 3, max_engines: int = 2) -> MoECase:
    spec = draw(moe_specs())
    trainer = draw(moe_trainers(spec, max_dp))
    engines = tuple(draw(st.lists(moe_engines(spec), min_size=1, max_size=max_engines)))
    return MoECase(spec, trainer, engines)


def _small_spec(E: int, L: int = 2, mlp_only: tuple[int, ...] = (), *, h: int = 8, ng: int = 2, d: int = 2,
                F: int = 8, moe_ffn: int = 4) -> ModelSpec:
    return ModelSpec(name=f"example-moe-h{h}g{ng}d{d}F{F}E{E}I{moe_ffn}L{L}m{mlp_only}", family="qwen3_moe",
                     hidden_size=8, num_layers=L, num_heads=h, num_kv_heads=ng, head_dim=d,
                     intermediate_size=F, vocab_size=50, tie_word_embeddings=False, dtype="float32",
                     num_experts=E, num_experts_per_tok=1, moe_intermediate_size=moe_ffn, mlp_only_layers=mlp_only)


def _small_glm(E: int, L: int = 2, first_k_dense: int = 1, *, h: int = 8, ng: int = 2, d: int = 2, F: int = 8,
               moe_ffn: int = 4, n_shared: int = 1, bias: bool = True, norms: bool = False) -> ModelSpec:
    return _small_spec(E, L, tuple(range(first_k_dense)), h=h, ng=ng, d=d, F=F, moe_ffn=moe_ffn).replace(
        name=f"example-glm4-moe-h{h}g{ng}d{d}F{F}E{E}I{moe_ffn}L{L}k{first_k_dense}S{n_shared}",
        family="glm4_moe", router="sigmoid", n_group=2 if E % 4 == 0 else 1, topk_group=1,
        routed_scaling_factor=2.5, shared_expert_intermediate_size=moe_ffn * n_shared,
        attention_bias=bias, qk_layernorm=norms, partial_rotary_factor=0.5)


# Always-run examples: the tiny preset (dense layer 0, tied, 8 experts) with EP spanning DP and
# grouped names, into an EP engine and a pure-TP engine; LAYOUTS.md §8.4's placement scaled
# down (Megatron ep=8, etp=1 over tp=2 x dp=4; SGLang t'=8, moe_ep=8: experts line up); and
# Megatron's default etp = tp with ep = dp, so DP replicas hold different experts.
TINY_EP = MoECase(PRESETS["tiny-qwen3-moe"],
                  MegatronParallel(tp=2, pp=2, dp=2, ep=4, etp=1, expert_names="grouped"),
                  (EngineParallel(tp=4, ep=4), EngineParallel(tp=2)))
ALIGNED_8_4 = MoECase(_small_spec(16),
                      MegatronParallel(tp=2, dp=4, ep=8, etp=1, norm_names="separate"),
                      (EngineParallel(tp=8, ep=8),))
DEFAULT_ETP = MoECase(_small_spec(4, L=3, mlp_only=(1,)),
                      MegatronParallel(tp=2, pp=3, dp=2, ep=2, make_vocab_size_divisible_by=16),
                      (EngineParallel(tp=4, ep=2), EngineParallel(tp=1)))
# GLM4-MoE: the tiny preset (dense layer 0, groups, shared expert, bias and q/k norms) as
# TINY_EP; and shared experts whose TP split differs from the experts' (tp=4, etp=2, ep=2
# over dp=2; engine tp=8 with moe_tp=2, and tp=2 with EP 2, so moe_tp=1), no bias, q/k norms.
TINY_GLM_EP = MoECase(PRESETS["tiny-glm4-moe"],
                      MegatronParallel(tp=2, pp=2, dp=2, ep=4, etp=1, expert_names="grouped"),
                      (EngineParallel(tp=4, ep=4), EngineParallel(tp=2)))
GLM_SHARED_TP = MoECase(_small_glm(4, L=3, n_shared=2, bias=False, norms=True),
                        MegatronParallel(tp=4, pp=2, pp_layers=(1, 2), dp=2, ep=2, etp=2, norm_names="separate"),
                        (EngineParallel(tp=8, ep=4), EngineParallel(tp=2, ep=2)))


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def trainer_ref(case: MoECase, full: dict[str, torch.Tensor], pad_value: float = 0.0) -> Shards:
    t = case.trainer
    return megatron_shards(case.spec, full, t.tp, t.pp, t.pp_layers,
                           divisible_by=t.make_vocab_size_divisible_by, norm_names=t.norm_names,
                           dp=t.dp, pad_value=pad_value, ep=t.ep, etp=t.etp,
                           expert_names=t.expert_names)


def addressed(shards: Shards) -> Shards:
    """The engine's 3-D expert stacks ``[E_loc, rows, cols]`` as 2-D ``[E_loc*rows, cols]``."""
    return [{n: x.reshape(-1, x.shape[-1]) if x.dim() == 3 else x for n, x in s.items()} for s in shards]


def engine_ref(spec: ModelSpec, full: dict[str, torch.Tensor], e: EngineParallel) -> Shards:
    return engine_shards(spec, full, e.tp, e.ep)


def engines_ref(case: MoECase, full: dict[str, torch.Tensor]) -> Shards:
    return addressed([s for e in case.engines for s in engine_ref(case.spec, full, e)])


def assert_ordered_layout(layout, shards: Shards, what: str, *, held: bool = False) -> None:
    """Local tensors, in order: (name, shape) equal the reference's; with ``held`` the reference
    shape is what the owner holds (3-D expert stacks) and the addressed shape its 2-D view."""
    assert layout.world_size == len(shards), f"{what}: {layout.world_size} ranks vs {len(shards)}"
    for r, (rl, shard) in enumerate(zip(layout.ranks, shards, strict=True)):
        want = [(n, tuple(x.shape)) for n, x in shard.items()]
        got = [(t.name, tuple(t.stored if held else t.shape)) for t in rl.tensors]
        assert got == want, f"{what} rank {r} ({rl.label}):\n layout    {got}\n reference {want}"
        if held:
            for t, x in zip(rl.tensors, shard.values(), strict=True):
                view = (x.shape[0] * x.shape[1], x.shape[2]) if x.dim() == 3 else tuple(x.shape)
                assert tuple(t.shape) == view, f"{what} rank {r} {t.name}: addressed {t.shape} != {view}"
                assert (t.held is not None) == (x.dim() == 3), f"{what} rank {r} {t.name}: held {t.held}"


# ---------------------------------------------------------------------------------------
# The references: independent of shardsync's layouts, and the documented index formulas
# ---------------------------------------------------------------------------------------

@FEW
@given(moe_specs())
def test_reference_moe_shapes_are_logical_tensors_in_order(spec: ModelSpec) -> None:
    assert [is_sparse(spec, n) for n in range(spec.num_layers)] == [
        spec.sparse_layer(n) for n in range(spec.num_layers)]
    assert list(hf_shapes(spec).items()) == list(logical_tensors(spec).items())


@FEW
@given(moe_cases(max_engines=1))
def test_reference_expert_rules_follow_index_formulas(case: MoECase) -> None:
    """Element by element from LAYOUTS.md §8.1-8.3, not narrow/cat: Megatron local expert k of
    EP rank q is global ``q*E/ep + k`` with fc1 row ``j`` = gate (j < I/etp) or up row
    ``etp_rank*I/etp + j mod I/etp``; SGLang ``w13[k, j]`` likewise over moe_tp, ``w2[k, :, j]``
    = down column ``moe_tp_rank*I/moe_tp + j``.  GLM4-MoE: the router's correction bias whole
    on every rank; shared-expert fc1 / ``gate_up_proj`` row ``j`` = gate (j < Is/t) or up row
    ``tp_rank*Is/t + j mod Is/t`` over the *attention* TP ``t`` (trainer tp, engine tp, not
    etp / moe_tp), fc2 / ``down_proj`` column ``j`` = down column ``tp_rank*Is/t + j``."""
    spec, t, (eng,) = case.spec, case.trainer, case.engines
    layer = next((n for n in range(spec.num_layers) if is_sparse(spec, n)), None)
    if layer is None:
        return
    full = synthetic_full(spec)
    E, Fe = spec.num_experts, spec.moe_intermediate_size
    x = f"model.layers.{layer}.mlp.experts."
    etp = t.expert_tp
    sizes = stage_sizes(spec.num_layers, t.pp, t.pp_layers)
    stage = next(s for s in range(t.pp) if sum(sizes[:s]) <= layer < sum(sizes[:s + 1]))
    local = layer - sum(sizes[:stage])
    bias = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    sh = f"model.layers.{layer}.mlp.shared_experts."

    def check_shared(fc1: torch.Tensor, fc2: torch.Tensor, tp: int, tp_rank: int, what) -> None:
        fs = shared_size(spec) // tp
        assert fc1.shape == (2 * fs, spec.hidden_size) and fc2.shape == (spec.hidden_size, fs), what
        for j in range(2 * fs):
            src = full[sh + f"{'gate' if j < fs else 'up'}_proj.weight"]
            assert torch.equal(fc1[j], src[tp_rank * fs + j % fs]), (what, j)
        for j in range(fs):
            assert torch.equal(fc2[:, j], full[sh + "down_proj.weight"][:, tp_rank * fs + j]), (what, j)

    for g, shard in enumerate(trainer_ref(case, full)):
        if g // (t.tp * t.dp) != stage:
            continue
        m = f"decoder.layers.{local}.mlp."
        assert (m + "router.expert_bias" in shard) == CORRECTION_BIAS[spec.family]
        if CORRECTION_BIAS[spec.family]:
            assert torch.equal(shard[m + "router.expert_bias"], full[bias])
        assert (m + "shared_experts.linear_fc1.weight" in shard) == (shared_size(spec) > 0)
        if shared_size(spec):
            check_shared(shard[m + "shared_experts.linear_fc1.weight"], shard[m + "shared_experts.linear_fc2.weight"],
                         t.tp, g % t.tp, ("megatron", g))
        ep_rank, etp_rank = (g % (t.tp * t.dp) // etp) % t.ep, g % etp
        f = Fe // etp
        for k in range(E // t.ep):
            e = ep_rank * (E // t.ep) + k
            names = ((f"decoder.layers.{local}.mlp.experts.local_experts.{k}.linear_fc1.weight",
                      f"decoder.layers.{local}.mlp.experts.local_experts.{k}.linear_fc2.weight")
                     if t.expert_names == "sequential" else
                     (f"decoder.layers.{local}.mlp.experts.linear_fc1.weight{k}",
                      f"decoder.layers.{local}.mlp.experts.linear_fc2.weight{k}"))
            fc1, fc2 = shard[names[0]], shard[names[1]]
            for j in range(2 * f):
                src = full[x + f"{e}.{'gate' if j < f else 'up'}_proj.weight"]
                assert torch.equal(fc1[j], src[etp_rank * f + j % f]), (g, k, j)
            for j in range(f):
                assert torch.equal(fc2[:, j], full[x + f"{e}.down_proj.weight"][:, etp_rank * f + j])
    moe_tp = eng.tp // eng.ep
    f = Fe // moe_tp
    for r, shard in enumerate(engine_ref(spec, full, eng)):
        w13 = shard[f"model.layers.{layer}.mlp.experts.w13_weight"]
        w2 = shard[f"model.layers.{layer}.mlp.experts.w2_weight"]
        assert (bias in shard) == CORRECTION_BIAS[spec.family]
        if CORRECTION_BIAS[spec.family]:
            assert torch.equal(shard[bias], full[bias])
        assert (sh + "gate_up_proj.weight" in shard) == (shared_size(spec) > 0)
        if shared_size(spec):
            check_shared(shard[sh + "gate_up_proj.weight"], shard[sh + "down_proj.weight"], eng.tp, r, ("engine", r))
        assert w13.shape == (E // eng.ep, 2 * f, spec.hidden_size) and w2.shape == (E // eng.ep, spec.hidden_size, f)
        for k in range(E // eng.ep):
            e = (r // moe_tp) * (E // eng.ep) + k
            for j in range(2 * f):
                src = full[x + f"{e}.{'gate' if j < f else 'up'}_proj.weight"]
                assert torch.equal(w13[k, j], src[(r % moe_tp) * f + j % f]), (r, k, j)
            for j in range(f):
                assert torch.equal(w2[k, :, j], full[x + f"{e}.down_proj.weight"][:, (r % moe_tp) * f + j])


def hf_config(spec: ModelSpec) -> dict:
    """The HF ``config.json`` of a drawn spec, written here from the raw fields (not the spec's
    own ``to_hf_config``), as ``Qwen3MoeConfig`` / ``Glm4MoeConfig`` spell it."""
    cfg = dict(hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
               num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
               head_dim=spec.head_dim, intermediate_size=spec.intermediate_size, vocab_size=spec.vocab_size,
               tie_word_embeddings=spec.tie_word_embeddings, num_experts_per_tok=spec.num_experts_per_tok,
               moe_intermediate_size=spec.moe_intermediate_size, pad_token_id=None)
    if spec.family == "glm4_moe":
        assert spec.shared_expert_intermediate_size % spec.moe_intermediate_size == 0
        return dict(cfg, model_type="glm4_moe", n_routed_experts=spec.num_experts,
                    n_shared_experts=spec.shared_expert_intermediate_size // spec.moe_intermediate_size,
                    first_k_dense_replace=len(spec.mlp_only_layers), n_group=spec.n_group,
                    topk_group=spec.topk_group, routed_scaling_factor=spec.routed_scaling_factor,
                    attention_bias=spec.attention_bias, use_qk_norm=spec.qk_layernorm,
                    partial_rotary_factor=spec.partial_rotary_factor)
    return dict(cfg, model_type="qwen3_moe", num_experts=spec.num_experts,
                decoder_sparse_step=spec.decoder_sparse_step, mlp_only_layers=list(spec.mlp_only_layers))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@settings(FEW, max_examples=8)
@given(moe_specs())
@example(PRESETS["tiny-glm4-moe"])
@example(_small_glm(4, n_shared=0, bias=False, norms=True))
def test_reference_shapes_are_transformers_checkpoint_tensors(spec: ModelSpec) -> None:
    """The reference's HF tensors are the ``transformers`` model's state dict (meta device, its
    fused ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` unfolded to per-expert
    checkpoint names; zero-size tensors, as HF builds for ``n_shared_experts = 0``, dropped)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**hf_config(spec))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs: dict[str, tuple[int, ...]] = {}
    for name, x in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            pre, E = name.rsplit(".", 1)[0] + ".", x.shape[0]
            for e in range(E):
                if name.endswith("gate_up_proj"):
                    assert x.shape[1] % 2 == 0
                    theirs[f"{pre}{e}.gate_proj.weight"] = theirs[f"{pre}{e}.up_proj.weight"] = (
                        x.shape[1] // 2, x.shape[2])
                else:
                    theirs[f"{pre}{e}.down_proj.weight"] = tuple(x.shape[1:])
        elif x.numel():
            theirs[name] = tuple(x.shape)
    if spec.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert hf_shapes(spec) == theirs


@FEW
@given(moe_specs(families=["glm4_moe"]), st.data())
def test_glm4_moe_optional_tensors_follow_the_config(spec: ModelSpec, data) -> None:
    """Attention bias and q/k norms follow ``attention_bias`` / ``use_qk_norm`` in both layouts;
    every sparse layer has the correction bias, shared experts iff ``Is > 0``; dense layers are
    the first k, none of them with router or shared experts."""
    t = data.draw(moe_trainers(spec, max_dp=1))
    e = data.draw(moe_engines(spec))
    assert qkv_bias(spec) == spec.attention_bias and qk_norm(spec) == spec.qk_layernorm
    engine = {x.name for rl in engine_layout(spec, e).ranks for x in rl.tensors}
    trainer = {x.name for rl in megatron_layout(spec, t).ranks for x in rl.tensors}
    for n in range(spec.num_layers):
        a = f"model.layers.{n}."
        assert (a + "self_attn.qkv_proj.bias" in engine) == spec.attention_bias
        q_norm, k_norm = a + "self_attn.q_norm.weight" in engine, a + "self_attn.k_norm.weight" in engine
        assert q_norm == k_norm == spec.qk_layernorm
        sparse = n >= len(spec.mlp_only_layers)
        assert (a + "mlp.gate.e_score_correction_bias" in engine) == sparse
        assert (a + "mlp.shared_experts.gate_up_proj.weight" in engine) == (sparse and shared_size(spec) > 0)
        assert (a + "mlp.gate_up_proj.weight" in engine) == (not sparse)
    for local in range(max(t.pp_layers or [spec.num_layers // t.pp])):
        m = f"decoder.layers.{local}."
        assert (m + "self_attention.linear_qkv.bias" in trainer) == spec.attention_bias
        assert (m + "self_attention.q_layernorm.weight" in trainer) == spec.qk_layernorm
    assert any(n.endswith("mlp.router.expert_bias") for n in trainer)
    assert any(".mlp.shared_experts." in n for n in trainer) == (shared_size(spec) > 0)


# ---------------------------------------------------------------------------------------
# (c) Layout names and shapes, in order, and every rank's pieces (full -> layout)
# ---------------------------------------------------------------------------------------

@PROPS
@given(moe_cases(max_engines=1))
@example(TINY_EP)
@example(ALIGNED_8_4)
@example(DEFAULT_ETP)
@example(TINY_GLM_EP)
@example(GLM_SHARED_TP)
def test_layouts_match_reference_names_shapes_and_pieces(case: MoECase) -> None:
    spec, t = case.spec, case.trainer
    full = synthetic_full(spec)
    sources = trainer_ref(case, full)
    trainer = megatron_layout(spec, t)
    assert_ordered_layout(trainer, sources, f"megatron layout {t}")
    # Every rank's pieces, DP replicas included (p2p reads only some of them).
    plan = build_plan(full_layout(spec), trainer)
    assert_shards_equal(execute_local(plan, [full]), sources, full, f"full->megatron {t}")
    check_plan_covers(plan, [full], sources, full)
    for e in dict.fromkeys(case.engines):
        want = engine_ref(spec, full, e)
        lay = engine_layout(spec, e)
        assert_ordered_layout(lay, want, f"engine layout {e}", held=True)
        plan = build_plan(full_layout(spec), lay)
        assert_shards_equal(execute_local(plan, [full]), addressed(want), full, f"full->engine {e}")
        check_plan_covers(plan, [full], addressed(want), full)


# ---------------------------------------------------------------------------------------
# (a) p2p: Megatron expert shards -> SGLang FusedMoE stacks of several engines
# ---------------------------------------------------------------------------------------

@PROPS
@given(moe_cases())
@example(TINY_EP)
@example(ALIGNED_8_4)
@example(DEFAULT_ETP)
@example(TINY_GLM_EP)
@example(GLM_SHARED_TP)
def test_p2p_matches_reference(case: MoECase) -> None:
    full = synthetic_full(case.spec)
    sources = trainer_ref(case, full, pad_value=MEGATRON_PAD)
    plan = case.topology.p2p_plan
    want = engines_ref(case, full)
    got = execute_local(plan, sources)
    assert_shards_equal(got, want, full, f"p2p {case.trainer} -> {case.engines}")
    check_plan_covers(plan, sources, want, full)
    # The engine holds 3-D stacks; the plan's 2-D destinations are views of exactly them.
    base = 0
    for e in case.engines:
        for r, held in enumerate(engine_ref(case.spec, full, e)):
            for name, x in held.items():
                assert torch.equal(got[base + r][name].view(x.shape), x), (e, r, name)
        base += e.tp


# ---------------------------------------------------------------------------------------
# (b) Broadcast: gather per stage, broadcast full tensors, narrow on every engine rank
# ---------------------------------------------------------------------------------------

@PROPS
@given(moe_cases())
@example(TINY_EP)
@example(DEFAULT_ETP)
@example(GLM_SHARED_TP)
def test_broadcast_composition_matches_reference(case: MoECase) -> None:
    spec, t = case.spec, case.trainer
    topo = case.topology
    full = synthetic_full(spec)
    sources = trainer_ref(case, full, pad_value=MEGATRON_PAD)

    gathered = check_gather(topo, sources, full)
    etp = t.expert_tp
    for c in topo.gather_plan.copies:
        stage, dp_rank, within = c.src // (t.tp * t.dp), (c.src // t.tp) % t.dp, c.src % (t.tp * t.dp)
        assert stage == c.dst, f"gather copy leaves its stage: {c}"
        if ".mlp.experts." in c.logical:
            # Expert-DP replicas hold identical experts; the stage's members are DP replica 0's
            # TP ranks plus expert-DP replica 0's expert ranks, and only they may send.
            edp_rank, _, _ = megatron_expert_rank(c.src, t.tp, t.dp, t.ep, etp)
            assert dp_rank == 0 or (edp_rank == 0 and within < etp * t.ep), (
                f"expert copy from neither DP replica 0 nor expert-DP replica 0: {c}")
        else:
            assert dp_rank == 0, f"gather copy not from DP replica 0: {c}"

    received = execute_local(topo.broadcast_plan, gathered)
    assert_shards_equal(received, [full] * topo.num_engine_ranks, full, "broadcast")
    check_plan_covers(topo.broadcast_plan, gathered, [full] * topo.num_engine_ranks, full)

    for i, e in enumerate(case.engines):
        narrow = topo.narrow_plan(i)
        want = addressed(engine_ref(spec, full, e))
        base = topo.engine_rank_offset(i)
        got = [execute_local(narrow, [received[base + r]])[r] for r in range(e.tp)]
        assert_shards_equal(got, want, full, f"narrow engine {i} ({e})")
        check_plan_covers(narrow, [full], want, full)


# ---------------------------------------------------------------------------------------
# Refusals: exactly the configs outside the rules, each with the rule named
# ---------------------------------------------------------------------------------------

def assert_refusal(build, violations: list, what: str) -> None:
    if not violations:
        build()
        return
    with pytest.raises(ValueError) as info:
        build()
    msg = str(info.value)
    if len(violations) == 1:
        assert names_rule(msg, violations[0]), f"{what}: {msg!r} does not name {violations[0][0]!r}"
    else:
        assert any(names_rule(msg, v) for v in violations), (
            f"{what}: {msg!r} names none of {[v[0] for v in violations]}")


@settings(PROPS, max_examples=60)
@given(st.data())
def test_invalid_configs_are_refused_naming_the_rule(data) -> None:
    """A valid config with one field redrawn at random: it builds iff it breaks no rule, and a
    refusal names the rule it breaks (often exactly one, being next to a valid config)."""
    spec = data.draw(moe_specs(), label="spec")
    t = data.draw(moe_trainers(spec), label="valid trainer")
    field = data.draw(st.sampled_from(["tp", "dp", "pp", "ep", "etp"]), label="redrawn")
    value = data.draw(st.integers(1, 8), label="to")
    fields = {"tp": t.tp, "dp": t.dp, "pp": t.pp, "ep": t.ep, "etp": t.etp, field: value}
    par = MegatronParallel(**fields, expert_names=t.expert_names, norm_names=t.norm_names)
    assert_refusal(lambda: megatron_layout(spec, par), megatron_violations(spec, **fields),
                   f"megatron {par}")
    e = data.draw(moe_engines(spec), label="valid engine")
    field = data.draw(st.sampled_from(["tp", "ep"]), label="redrawn")
    fields = {"tp": e.tp, "ep": e.ep, field: data.draw(st.integers(1, 8), label="to")}
    eng = EngineParallel(**fields)
    assert_refusal(lambda: engine_layout(spec, eng), engine_violations(spec, **fields), f"engine {eng}")


# One hand-made config per rule that breaks exactly that rule (and the random test above
# mostly breaks several at once).
MEGATRON_SINGLE = [
    (HEADS, _small_spec(4, h=6, ng=1), dict(tp=4)),
    (KV, _small_spec(4, h=6, ng=2, d=3, F=6, moe_ffn=6), dict(tp=3)),
    (QKV_ROWS, _small_spec(4, h=4, ng=1, d=1), dict(tp=4)),
    (DENSE_FFN, _small_spec(4, mlp_only=(0,), F=6), dict(tp=4)),
    (PP_SPLIT, _small_spec(4, L=3), dict(tp=2, pp=2)),
    (EXPERT_GRID, _small_spec(4), dict(tp=2, ep=2, etp=2)),
    (EXPERTS_EP, _small_spec(3), dict(tp=2, dp=2, ep=2, etp=1)),
    (MOE_FFN_ETP, _small_spec(4, moe_ffn=3), dict(tp=2)),
    (SHARED_FFN, _small_glm(4, moe_ffn=2, n_shared=3), dict(tp=4, etp=1)),  # Is=6: etp=1 / ep=1 do not help
]
ENGINE_SINGLE = [
    (HEADS, _small_spec(4, h=6, ng=1), dict(tp=4)),
    (KV, _small_spec(4, h=6, ng=2, F=6, moe_ffn=6), dict(tp=3)),
    (DENSE_FFN, _small_spec(4, mlp_only=(0,), F=6), dict(tp=4)),
    (ENGINE_EP_TP, _small_spec(4), dict(tp=2, ep=4)),
    (EXPERTS_EP, _small_spec(3), dict(tp=2, ep=2)),
    (MOE_FFN_MOE_TP, _small_spec(4, moe_ffn=3), dict(tp=2)),
    (SHARED_FFN, _small_glm(4, moe_ffn=2, n_shared=3), dict(tp=4, ep=4)),  # moe_tp=1, but Is=6 over tp=4
]


@pytest.mark.parametrize(("rule", "spec", "kw"), MEGATRON_SINGLE, ids=[r[0][0] for r in MEGATRON_SINGLE])
def test_megatron_refuses_each_rule_by_name(rule, spec: ModelSpec, kw: dict) -> None:
    args = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "etp": None, **kw}
    assert megatron_violations(spec, **args) == [rule]
    assert_refusal(lambda: megatron_layout(spec, MegatronParallel(**args)), [rule], f"megatron {args}")


@pytest.mark.parametrize(("rule", "spec", "kw"), ENGINE_SINGLE, ids=[r[0][0] for r in ENGINE_SINGLE])
def test_engine_refuses_each_rule_by_name(rule, spec: ModelSpec, kw: dict) -> None:
    args = {"tp": 1, "ep": 1, **kw}
    assert engine_violations(spec, **args) == [rule]
    assert_refusal(lambda: engine_layout(spec, EngineParallel(**args)), [rule], f"engine {args}")


def test_dense_ffn_rule_skips_all_sparse_models() -> None:
    """intermediate_size need not split when no layer is dense (and must when one is)."""
    spec = _small_spec(4, F=6)
    megatron_layout(spec, MegatronParallel(tp=4))
    engine_layout(spec, EngineParallel(tp=4))


def test_dense_models_refuse_expert_parallel() -> None:
    dense = PRESETS["tiny-qwen3-moe"].replace(family="qwen3", num_experts=0, num_experts_per_tok=0,
                                              moe_intermediate_size=0, mlp_only_layers=())
    for par in (MegatronParallel(tp=2, dp=2, ep=2), MegatronParallel(tp=2, etp=1)):
        with pytest.raises(ValueError, match="mixture-of-experts"):
            megatron_layout(dense, par)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        engine_layout(dense, EngineParallel(tp=2, ep=2))


@pytest.mark.parametrize("build", [
    lambda s: megatron_layout(s, MegatronParallel(tp=2, ep=0)),
    lambda s: megatron_layout(s, MegatronParallel(tp=2, etp=0)),
    lambda s: engine_layout(s, EngineParallel(tp=2, ep=0)),
], ids=["megatron-ep0", "megatron-etp0", "engine-ep0"])
def test_zero_expert_sizes_are_refused_by_name(build) -> None:
    with pytest.raises(ValueError, match=r">= 1"):
        build(_small_spec(4))
