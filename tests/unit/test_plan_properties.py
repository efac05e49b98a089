"""Property tests: shardsync's plans against independent references of the loading rules.

Every logical tensor is filled with distinct integer ids (``reference_rules.synthetic_full``),
plans are executed in memory, and the result must equal, element for element, what the
reference loaders in ``reference_rules`` build with plain ``narrow``/``cat``/``view``.
A mismatch message decodes the ids, e.g. ``got model.layers.0.self_attn.k_proj.weight[3, 1]``.
"""

from __future__ import annotations

import ast
import math
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardsync.layout import (
    EngineParallel,
    MegatronParallel,
    concat_layouts,
    engine_layout,
    full_layout,
    logical_tensors,
    megatron_layout,
)
from shardsync.plan import Plan, Wire, build_plan, execute_local, make_buckets
from shardsync.spec import ModelSpec
from shardsync.topology import Topology
from tests.unit.reference_rules import (
    FUSED_GATE_UP,
    POST_NORMS,
    QK_NORM,
    QKV_BIAS,
    engine_shards,
    fused_qkv,
    hf_shapes,
    megatron_shards,
    synthetic_full,
)

PROPS = settings(max_examples=60, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(PROPS, max_examples=20)
MEGATRON_PAD = -7.0  # Megatron vocab padding rows may hold anything; they must never be copied.

Shards = list[dict[str, torch.Tensor]]


# ---------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------

DENSE_FAMILIES = ["qwen2", "qwen3", "llama", "glm4"]
# GLM-4-0414 rotates half of each head; irrelevant to layouts, set as the real models have it.
ROTARY = {"glm4": {"partial_rotary_factor": 0.5}}


@st.composite
def specs(draw) -> ModelSpec:
    family = draw(st.sampled_from(DENSE_FAMILIES))
    ng = draw(st.sampled_from([1, 1, 2, 2, 3, 4, 6]))
    heads = ng * draw(st.integers(1, 4))
    head_dim = draw(st.sampled_from([2, 4, 6, 8]))
    hidden = draw(st.integers(1, 12))
    ffn = draw(st.sampled_from([4, 6, 8, 12, 16, 24]))
    # Mostly not a multiple of 64 (engine padding), sometimes aligned (whole-shard copies).
    vocab = draw(st.sampled_from([64, 128, 192, 256, 384]) if draw(st.integers(0, 3)) == 0
                 else st.integers(1, 300))
    layers = draw(st.integers(1, 5))
    tied = draw(st.booleans())
    name = f"rand-{family}-h{heads}g{ng}d{head_dim}H{hidden}F{ffn}V{vocab}L{layers}{'t' if tied else 'u'}"
    return ModelSpec(name=name, family=family, hidden_size=hidden, num_layers=layers,
                     num_heads=heads, num_kv_heads=ng, head_dim=head_dim,
                     intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied,
                     dtype="float32", **ROTARY.get(family, {}))


def pick_tp(draw, valid: list[int]) -> int:
    """Mostly a TP > 1 (1 is where hypothesis would otherwise spend its time)."""
    if len(valid) > 1 and draw(st.integers(0, 3)):
        valid = valid[1:]
    return draw(st.sampled_from(valid))


def valid_tps(spec: ModelSpec, limit: int, *, megatron: bool) -> list[int]:
    """TP sizes both frameworks accept (Megatron also needs the fused QKV rows to split)."""
    h, ng, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = []
    for t in range(1, limit + 1):
        if h % t or spec.intermediate_size % t or (ng % t and t % ng):
            continue
        if megatron and ((h + 2 * ng) * d) % t:
            continue
        out.append(t)
    return out


@st.composite
def megatron_pars(draw, spec: ModelSpec, max_dp: int = 1) -> MegatronParallel:
    tp = pick_tp(draw, valid_tps(spec, 8, megatron=True))
    L = spec.num_layers
    pp = draw(st.integers(1, min(L, 4)))
    pp_layers = None
    if L % pp or draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, L), min_size=pp - 1, max_size=pp - 1)))
        bounds = [0, *cuts, L]
        pp_layers = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    return MegatronParallel(
        tp=tp, pp=pp, dp=draw(st.integers(1, max_dp)), pp_layers=pp_layers,
        make_vocab_size_divisible_by=draw(st.sampled_from([1, 2, 16, 64, 128])),
        norm_names=draw(st.sampled_from(["fused", "separate"])),
    )


@st.composite
def engine_tps(draw, spec: ModelSpec) -> int:
    return pick_tp(draw, valid_tps(spec, 16, megatron=False))


def _spec(family: str, h: int, ng: int, d: int, H: int, F: int, V: int, L: int,
          tied: bool) -> ModelSpec:
    return ModelSpec(name=f"example-{family}-h{h}g{ng}V{V}", family=family, hidden_size=H,
                     num_layers=L, num_heads=h, num_kv_heads=ng, head_dim=d,
                     intermediate_size=F, vocab_size=V, tie_word_embeddings=tied, dtype="float32",
                     **ROTARY.get(family, {}))


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    trainer: MegatronParallel
    engines: tuple[int, ...]


@st.composite
def cases(draw, max_dp: int = 2, max_engines: int = 3) -> Case:
    spec = draw(specs())
    trainer = draw(megatron_pars(spec, max_dp))
    engines = tuple(draw(st.lists(engine_tps(spec), min_size=1, max_size=max_engines)))
    return Case(spec, trainer, engines)


# Always-run examples besides the random ones: Megatron Case B (tp > kv heads, uneven PP,
# DP 2, tied embedding on both end stages) into engines with KV replication; and SGLang's
# 64*tp vocab fallback (pad64(100) = 128 is not divisible by 3 or 6) with untied lm_head.
CASE_B = Case(_spec("qwen3", 16, 2, 4, 4, 16, 100, 3, True),
              MegatronParallel(tp=8, pp=2, dp=2, pp_layers=(1, 2)), (8, 16, 2))
VOCAB_FALLBACK = Case(_spec("qwen2", 6, 3, 2, 3, 12, 100, 2, False),
                      MegatronParallel(tp=3, make_vocab_size_divisible_by=16, norm_names="separate"),
                      (6, 3, 1))
# GLM4 (post norms, fused gate_up checkpoint tensor) in Case B (tp 4 > 2 kv heads, like
# GLM-4-9B's 2 kv heads), PP 2, untied, into engines with and without KV replication.
GLM4_CASE = Case(_spec("glm4", 8, 2, 4, 4, 16, 100, 2, False),
                 MegatronParallel(tp=4, pp=2, dp=1, make_vocab_size_divisible_by=16), (4, 8, 1))


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------

def megatron_ref(case: Case, full: dict[str, torch.Tensor], pad_value: float = 0.0) -> Shards:
    t = case.trainer
    return megatron_shards(case.spec, full, t.tp, t.pp, t.pp_layers,
                           divisible_by=t.make_vocab_size_divisible_by,
                           norm_names=t.norm_names, dp=t.dp, pad_value=pad_value)


def engines_ref(case: Case, full: dict[str, torch.Tensor]) -> Shards:
    return [shard for tp in case.engines for shard in engine_shards(case.spec, full, tp)]


def engines_layout(case: Case):
    return concat_layouts("engine", [engine_layout(case.spec, EngineParallel(tp=t))
                                     for t in case.engines])


def locate(full: dict[str, torch.Tensor], value: float) -> str:
    """Decode a synthetic id back to ``name[coords]``."""
    if value == 0:
        return "0 (padding / never written)"
    if value == MEGATRON_PAD:
        return f"{value} (Megatron vocab padding row)"
    for name, t in full.items():
        base = int(t.flatten()[0])
        if base <= value < base + t.numel():
            flat, coords = int(value) - base, []
            for s in reversed(t.shape):
                coords.append(flat % s)
                flat //= s
            return f"{name}{list(reversed(coords))}"
    return f"{value} (not an id)"


def assert_shards_equal(got: Shards, want: Shards, full: dict[str, torch.Tensor], what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} ranks, reference has {len(want)}"
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        missing, extra = sorted(set(w) - set(g)), sorted(set(g) - set(w))
        assert not missing and not extra, f"{what} rank {r}: missing {missing}, unexpected {extra}"
        for name, wt in w.items():
            gt = g[name]
            assert gt.shape == wt.shape, f"{what} rank {r} {name}: shape {tuple(gt.shape)} != {tuple(wt.shape)}"
            assert gt.dtype == wt.dtype, f"{what} rank {r} {name}: dtype {gt.dtype} != {wt.dtype}"
            if not torch.equal(gt, wt):
                idx = tuple((gt != wt).nonzero()[0].tolist())
                raise AssertionError(
                    f"{what} rank {r} {name}{list(idx)}: got {locate(full, gt[idx].item())}, "
                    f"want {locate(full, wt[idx].item())} "
                    f"({int((gt != wt).sum())} of {wt.numel()} elements differ)")


def assert_layout_matches(layout, shards: Shards, what: str) -> None:
    """The layout's local tensors (names, shapes) are exactly the reference's, rank by rank."""
    assert layout.world_size == len(shards), f"{what}: {layout.world_size} ranks vs {len(shards)}"
    for r, (rl, shard) in enumerate(zip(layout.ranks, shards, strict=True)):
        got = {t.name: tuple(t.shape) for t in rl.tensors}
        want = {n: tuple(x.shape) for n, x in shard.items()}
        assert got == want, f"{what} rank {r} ({rl.label}): layout {got} != reference {want}"


def region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def check_plan_covers(plan: Plan, sources: Shards, want: Shards, full: dict[str, torch.Tensor],
                      copies=None) -> None:
    """Independent coverage proof of ``plan`` (or of ``copies``, e.g. bucket parts).

    Every copy stays inside both tensors and reads exactly the logical box it claims;
    every destination element the reference fills (nonzero) is written exactly once,
    and padding (zero in the reference) is never written.
    """
    copies = plan.copies if copies is None else copies
    counts = [{n: torch.zeros(t.shape, dtype=torch.int32) for n, t in w.items()} for w in want]
    volume: dict[tuple[int, str], int] = defaultdict(int)
    for c in copies:
        src_shape = tuple(sources[c.src][c.src_local].shape)
        dst_shape = tuple(counts[c.dst][c.dst_local].shape)
        for o, s, n in zip(c.src_offsets, c.sizes, src_shape, strict=True):
            assert 0 <= o and o + s <= n, f"{c} reads outside {c.src_local}{src_shape}"
        for o, s, n in zip(c.dst_offsets, c.sizes, dst_shape, strict=True):
            assert 0 <= o and o + s <= n, f"{c} writes outside {c.dst_local}{dst_shape}"
        got = sources[c.src][c.src_local][region(c.src_offsets, c.sizes)]
        claimed = full[c.logical][region(c.logical_offsets, c.sizes)]
        assert torch.equal(got, claimed), f"{c} does not read the logical box it names"
        counts[c.dst][c.dst_local][region(c.dst_offsets, c.sizes)] += 1
        volume[(c.dst, c.dst_local)] += math.prod(c.sizes)
    for r, w in enumerate(want):
        for name, wt in w.items():
            cnt = counts[r][name]
            assert cnt.numel() == 0 or int(cnt.max()) <= 1, f"dst {r} {name}: an element is written twice"
            needed = wt != 0
            assert torch.equal(cnt == 1, needed), (
                f"dst {r} {name}: {int((needed & (cnt == 0)).sum())} elements never written, "
                f"{int((~needed & (cnt == 1)).sum())} padding elements written")
            assert volume[(r, name)] == int(needed.sum()), f"dst {r} {name}: copy volumes"


# ---------------------------------------------------------------------------------------
# The references themselves: independence and agreement with the documented index formulas
# ---------------------------------------------------------------------------------------

def test_reference_is_independent_of_shardsync() -> None:
    tree = ast.parse((Path(__file__).parent / "reference_rules.py").read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.add(node.module or "")
    assert modules <= {"__future__", "torch", "shardsync.spec"}, modules


@FEW
@given(specs())
def test_reference_shapes_match_logical_tensors(spec: ModelSpec) -> None:
    assert hf_shapes(spec) == logical_tensors(spec)


@FEW
@given(specs())
def test_reference_fused_qkv_follows_index_formula(spec: ModelSpec) -> None:
    """LAYOUTS.md §4.1 inverse: fused row G -> (g, s, j) -> q/k/v row, one row at a time."""
    full = synthetic_full(spec)
    a = "model.layers.0.self_attn."
    q, k, v = (full[a + f"{x}_proj.weight"] for x in "qkv")
    fused = fused_qkv(spec, q, k, v)
    d, p = spec.head_dim, spec.num_heads // spec.num_kv_heads
    assert fused.shape[0] == (spec.num_heads + 2 * spec.num_kv_heads) * d
    for G in range(fused.shape[0]):
        j, u = G % d, G // d
        g, s = u // (p + 2), u % (p + 2)
        row = q[(g * p + s) * d + j] if s < p else (k if s == p else v)[g * d + j]
        assert torch.equal(fused[G], row), G


@FEW
@given(specs(), st.data())
def test_reference_engine_qkv_follows_loader_table(spec: ModelSpec, data) -> None:
    """LAYOUTS.md §7.1, row by row: [q of my heads | k of my kv heads | v of my kv heads]."""
    tp = data.draw(engine_tps(spec))
    full = synthetic_full(spec)
    a = "model.layers.0.self_attn."
    d, h, ng = spec.head_dim, spec.num_heads, spec.num_kv_heads
    nq = h // tp
    for r, shard in enumerate(engine_shards(spec, full, tp)):
        heads = [r // (tp // ng)] if tp >= ng else list(range(r * ng // tp, (r + 1) * ng // tp))
        rows = [("q", i * d + j) for i in range(r * nq, (r + 1) * nq) for j in range(d)]
        rows += [(x, kv * d + j) for x in "kv" for kv in heads for j in range(d)]
        want = torch.stack([full[a + f"{x}_proj.weight"][y] for x, y in rows])
        assert torch.equal(shard[a + "qkv_proj.weight"], want)


@FEW
@given(specs(), st.data())
def test_reference_fc1_follows_index_formula(spec: ModelSpec, data) -> None:
    """LAYOUTS.md §5, row by row: Megatron ``linear_fc1`` local row ``x`` of rank ``r`` is gate
    row ``r*f + x`` (``x < f``), else up row ``r*f + x - f``; for GLM4 the up rows sit at
    ``F + ...`` of the fused ``gate_up_proj``.  The engine's ``gate_up_proj`` is the same."""
    tp = data.draw(st.sampled_from(valid_tps(spec, 8, megatron=True)))
    full = synthetic_full(spec)
    F, f, a = spec.intermediate_size, spec.intermediate_size // tp, "model.layers.0."
    if FUSED_GATE_UP[spec.family]:
        fused = full[a + "mlp.gate_up_proj.weight"]
        rows = {"gate": [fused[y] for y in range(F)], "up": [fused[F + y] for y in range(F)]}
    else:
        rows = {x: list(full[a + f"mlp.{x}_proj.weight"]) for x in ("gate", "up")}
    trainer, engine = megatron_shards(spec, full, tp), engine_shards(spec, full, tp)
    for r in range(tp):
        want = torch.stack([rows["gate"][r * f + x] if x < f else rows["up"][r * f + x - f]
                            for x in range(2 * f)])
        assert torch.equal(trainer[r]["decoder.layers.0.mlp.linear_fc1.weight"], want), r
        assert torch.equal(engine[r][a + "mlp.gate_up_proj.weight"], want), r


# ---------------------------------------------------------------------------------------
# 1-2. Loading full HF tensors
# ---------------------------------------------------------------------------------------

@PROPS
@given(specs(), st.data())
def test_full_to_engine_matches_reference(spec: ModelSpec, data) -> None:
    tp = data.draw(engine_tps(spec), label="engine tp")
    full = synthetic_full(spec)
    plan = build_plan(full_layout(spec), engine_layout(spec, EngineParallel(tp=tp)))
    want = engine_shards(spec, full, tp)
    assert_shards_equal(execute_local(plan, [full]), want, full, f"full->engine(tp={tp})")
    check_plan_covers(plan, [full], want, full)


@PROPS
@given(specs(), st.data())
def test_full_to_megatron_matches_reference(spec: ModelSpec, data) -> None:
    par = data.draw(megatron_pars(spec, max_dp=2), label="trainer")
    full = synthetic_full(spec)
    plan = build_plan(full_layout(spec), megatron_layout(spec, par))
    want = megatron_ref(Case(spec, par, ()), full)
    assert_shards_equal(execute_local(plan, [full]), want, full, f"full->megatron {par}")
    check_plan_covers(plan, [full], want, full)


# ---------------------------------------------------------------------------------------
# 3. Shard-level p2p: Megatron ranks -> several engines of different TP
# ---------------------------------------------------------------------------------------

@PROPS
@given(cases())
@example(CASE_B)
@example(VOCAB_FALLBACK)
@example(GLM4_CASE)
def test_megatron_to_engines_p2p_matches_reference(case: Case) -> None:
    full = synthetic_full(case.spec)
    sources = megatron_ref(case, full, pad_value=MEGATRON_PAD)
    plan = build_plan(megatron_layout(case.spec, case.trainer), engines_layout(case))
    want = engines_ref(case, full)
    assert_layout_matches(plan.src, sources, "megatron layout")
    assert_layout_matches(plan.dst, want, "engines layout")
    assert_shards_equal(execute_local(plan, sources), want, full, f"p2p {case}")
    check_plan_covers(plan, sources, want, full)


# ---------------------------------------------------------------------------------------
# 4. Broadcast path: gather per stage, broadcast full tensors, narrow on every engine rank
# ---------------------------------------------------------------------------------------

def check_gather(topo, sources: Shards, full: dict[str, torch.Tensor]) -> Shards:
    """Broadcast step 1 run locally: one source per stage holding exactly what that stage owns."""
    spec, t = topo.spec, topo.trainer
    gathered = execute_local(topo.gather_plan, sources)
    assert len(gathered) == t.pp
    bounds = [0]
    for n in t.pp_layers or [spec.num_layers // t.pp] * t.pp:
        bounds.append(bounds[-1] + n)

    def owner(name: str) -> int:
        if name == "model.embed_tokens.weight":
            return 0
        if name.startswith("model.layers."):
            layer = int(name.split(".")[2])
            return next(s for s in range(t.pp) if bounds[s] <= layer < bounds[s + 1])
        return t.pp - 1

    want = [{n: x for n, x in full.items() if owner(n) == s} for s in range(t.pp)]
    assert_shards_equal(gathered, want, full, "gather")
    check_plan_covers(topo.gather_plan, sources, want, full)
    return gathered


@PROPS
@given(cases())
@example(CASE_B)
@example(VOCAB_FALLBACK)
@example(GLM4_CASE)
def test_broadcast_composition_matches_reference(case: Case) -> None:
    spec, t = case.spec, case.trainer
    topo = Topology(spec, t, tuple(EngineParallel(tp=e) for e in case.engines))
    full = synthetic_full(spec)
    sources = megatron_ref(case, full, pad_value=MEGATRON_PAD)
    assert_layout_matches(topo.trainer_layout, sources, "megatron layout")

    # Step 1: one source per stage, holding exactly what that stage owns, from DP replica 0.
    gather = topo.gather_plan
    gathered = check_gather(topo, sources, full)
    for c in gather.copies:
        pp_rank, dp_rank, _ = t.coords(c.src)
        assert dp_rank == 0 and pp_rank == c.dst, f"gather copy leaves its stage / DP replica 0: {c}"

    # Step 2: every engine rank receives every logical tensor whole.
    received = execute_local(topo.broadcast_plan, gathered)
    assert_shards_equal(received, [full] * topo.num_engine_ranks, full, "broadcast")
    check_plan_covers(topo.broadcast_plan, gathered, [full] * topo.num_engine_ranks, full)

    # Step 3: each engine rank narrows its own full copy.
    for e, tp in enumerate(case.engines):
        narrow = topo.narrow_plan(e)
        want = engine_shards(spec, full, tp)
        base = topo.engine_rank_offset(e)
        got = [execute_local(narrow, [received[base + r]])[r] for r in range(tp)]
        assert_shards_equal(got, want, full, f"narrow engine {e} (tp={tp})")
        check_plan_covers(narrow, [full], want, full)


# ---------------------------------------------------------------------------------------
# 6. Buckets
# ---------------------------------------------------------------------------------------

def run_buckets(buckets, sources: Shards, dests: Shards) -> None:
    """Pack each bucket into one flat buffer on the sender, unpack on the receiver."""
    for b in buckets:
        buf = torch.full((b.numel,), float("nan"))
        for c, off in zip(b.copies, b.offsets, strict=True):
            buf[off:off + c.numel] = sources[b.src][c.src_local][region(c.src_offsets, c.sizes)].reshape(-1)
        assert not torch.isnan(buf).any(), "bucket buffer has holes"
        for c, off in zip(b.copies, b.offsets, strict=True):
            dests[b.dst][c.dst_local][region(c.dst_offsets, c.sizes)] = buf[off:off + c.numel].view(c.sizes)


@PROPS
@given(cases(max_dp=2, max_engines=2), st.integers(1, 600))
@example(CASE_B, 20)
@example(VOCAB_FALLBACK, 7)
@example(GLM4_CASE, 13)
def test_buckets_preserve_every_element(case: Case, budget: int) -> None:
    full = synthetic_full(case.spec)
    sources = megatron_ref(case, full, pad_value=MEGATRON_PAD)
    plan = build_plan(megatron_layout(case.spec, case.trainer), engines_layout(case))
    assert_layout_matches(plan.src, sources, "megatron layout")
    budget = max(budget, plan.itemsize)
    max_numel = budget // plan.itemsize
    buckets = make_buckets(plan, budget)

    # Pure: derived twice, and from a plan rebuilt from scratch, the sequence is identical.
    again = build_plan(megatron_layout(case.spec, case.trainer), engines_layout(case))
    assert make_buckets(plan, budget) == buckets == make_buckets(again, budget)
    assert plan.fingerprint == again.fingerprint

    per_link: dict[tuple[int, int], list] = defaultdict(list)
    for b in buckets:
        per_link[(b.src, b.dst)].append(b)
        assert all(c.src == b.src and c.dst == b.dst for c in b.copies), "copy on the wrong link"
        assert list(b.offsets) == [sum(c.numel for c in b.copies[:i]) for i in range(len(b.copies))], (
            f"bucket {b.src}->{b.dst}#{b.index}: offsets are not the packed prefix sums")
        assert b.numel == sum(c.numel for c in b.copies), f"bucket {b.src}->{b.dst}#{b.index}: numel"
        if b.numel > max_numel:
            (only,) = b.copies  # over budget: a single copy that is one row
            assert math.prod(only.sizes[:-1]) == 1, f"over-budget bucket is not one row: {only.sizes}"
    for link, bs in per_link.items():
        assert [b.index for b in bs] == list(range(len(bs))), f"bucket indices of {link}"
        assert sum(b.numel for b in bs) == sum(c.numel for c in plan.copies_on(*link)), (
            f"link {link}: buckets carry a different number of elements than the plan")
    assert set(per_link) == set(plan.link_bytes), "buckets and plan disagree on the links"

    want = engines_ref(case, full)
    parts = [c for b in buckets for c in b.copies]
    check_plan_covers(plan, sources, want, full, copies=parts)
    dests = [{n: torch.zeros_like(x) for n, x in w.items()} for w in want]
    run_buckets(buckets, sources, dests)
    assert_shards_equal(dests, want, full, f"bucketed p2p (budget {budget} B)")


MUTATIONS = ("add_engine", "norm_names", "wire_dtype", "vocab", "tie", "trainer_tp")


@FEW
@given(cases(max_dp=2, max_engines=2), st.sampled_from(MUTATIONS))
def test_fingerprint_stable_and_config_sensitive(case: Case, mutation: str) -> None:
    def fingerprint(c: Case, wire: str | None = None) -> str:
        return build_plan(megatron_layout(c.spec, c.trainer), engines_layout(c), Wire(wire)).fingerprint

    fp = fingerprint(case)
    assert fp == fingerprint(Case(case.spec.replace(), case.trainer, tuple(case.engines)))
    spec, t = case.spec, case.trainer
    if mutation == "add_engine":
        other, wire = Case(spec, t, (*case.engines, 1)), None
    elif mutation == "norm_names":
        names = "separate" if t.norm_names == "fused" else "fused"
        other, wire = Case(spec, replace(t, norm_names=names), case.engines), None
    elif mutation == "wire_dtype":
        other, wire = case, "bfloat16"
    elif mutation == "vocab":
        other, wire = Case(spec.replace(vocab_size=spec.vocab_size + 1), t, case.engines), None
    elif mutation == "tie":
        other, wire = Case(spec.replace(tie_word_embeddings=not spec.tie_word_embeddings), t, case.engines), None
    else:
        tps = [x for x in valid_tps(spec, 8, megatron=True) if x != t.tp]
        if not tps:
            return
        other, wire = Case(spec, replace(t, tp=tps[0]), case.engines), None
    assert fingerprint(other, wire) != fp, mutation


# ---------------------------------------------------------------------------------------
# Families: the optional tensors appear exactly where the family says
# ---------------------------------------------------------------------------------------

@FEW
@given(specs(), st.data())
def test_optional_tensors_follow_family(spec: ModelSpec, data) -> None:
    tp = data.draw(engine_tps(spec))
    names = {t.name for rl in engine_layout(spec, EngineParallel(tp=tp)).ranks for t in rl.tensors}
    assert ("model.layers.0.self_attn.qkv_proj.bias" in names) == QKV_BIAS[spec.family]
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == QK_NORM[spec.family]
    assert ("lm_head.weight" in names) == (not spec.tie_word_embeddings)
    post = POST_NORMS[spec.family]
    assert ("model.layers.0.post_self_attn_layernorm.weight" in names) == post
    assert ("model.layers.0.post_mlp_layernorm.weight" in names) == post
    trainer = {t.name for rl in megatron_layout(spec, MegatronParallel(tp=1)).ranks for t in rl.tensors}
    assert ("decoder.layers.0.post_self_attn_layernorm.weight" in trainer) == post
    assert ("decoder.layers.0.post_mlp_layernorm.weight" in trainer) == post
    hf = logical_tensors(spec)
    assert ("model.layers.0.mlp.gate_up_proj.weight" in hf) == FUSED_GATE_UP[spec.family]
    assert ("model.layers.0.mlp.gate_proj.weight" in hf) != FUSED_GATE_UP[spec.family]


@FEW
@given(cases(max_dp=2, max_engines=3), st.integers(min_value=64, max_value=4096))
def test_rank_views_are_the_plan_filtered(case: Case, budget: int) -> None:
    """A process makes only its own links' copies (``copies_from``/``copies_to``/``copies_on``)
    and their buckets; they equal the whole plan's, filtered, and ``link_bytes`` (summed per read
    list without making copies) equals the copies' bytes."""
    plan = build_plan(megatron_layout(case.spec, case.trainer), engines_layout(case))
    everything = plan.copies
    all_buckets = make_buckets(plan, budget)
    for s in range(plan.src.world_size):
        mine = plan.copies_from(s)
        assert mine == [c for c in everything if c.src == s], f"copies_from({s})"
        assert make_buckets(plan, budget, mine) == [b for b in all_buckets if b.src == s], f"buckets of {s}"
    for d in range(plan.dst.world_size):
        assert plan.copies_to(d) == [c for c in everything if c.dst == d], f"copies_to({d})"
        for s in range(plan.src.world_size):
            assert plan.copies_on(s, d) == [c for c in everything if (c.src, c.dst) == (s, d)]
    summed: dict[tuple[int, int], int] = defaultdict(int)
    for c in everything:
        summed[(c.src, c.dst)] += c.numel * plan.itemsize
    assert plan.link_bytes == dict(summed)


def test_fingerprint_covers_the_holder_picked() -> None:
    """Two plans that differ only in which replica sends a read differ in fingerprint."""
    spec = _spec("qwen3", 4, 2, 8, 32, 64, 128, 2, tied=False)
    plan = build_plan(megatron_layout(spec, MegatronParallel(tp=2, dp=2)), engine_layout(spec, EngineParallel(tp=2)))
    d, ranks = next((d, r) for d, r in enumerate(plan.picks.ranks) if r is not None)
    i = next(i for i, read in enumerate(plan.picks.lists[plan.picks.order[d]]) if len(read[1]) > 1)
    swapped = ranks.copy()
    read = plan.picks.lists[plan.picks.order[d]][i]
    swapped[i] = next(h[0] for h in read[1] if h[0] != ranks[i])
    moved = replace(plan, picks=replace(plan.picks, ranks=(*plan.picks.ranks[:d], swapped, *plan.picks.ranks[d + 1:])))
    assert moved.copies != plan.copies
    assert moved.fingerprint != plan.fingerprint
