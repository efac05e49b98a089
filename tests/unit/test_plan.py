"""Plain unit tests of plans: aligned TP locality, traffic ratios, refusals, invalid configs."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest

from shardsync.layout import (
    EngineParallel,
    Layout,
    MegatronParallel,
    RankLayout,
    concat_layouts,
    engine_layout,
    full_layout,
    megatron_layout,
)
from shardsync.plan import PlanError, build_plan
from shardsync.presets import PRESETS
from shardsync.spec import ModelSpec
from shardsync.topology import Topology

LAYER = re.compile(r"layers\.(\d+)\.")


def layer_of(name: str) -> int:
    return int(LAYER.search(name).group(1))


def aligned_plan(preset: str, tp: int, vocab: int = 1024):
    """Megatron TP ``tp`` -> one engine of TP ``tp``; the vocab chosen so both pad to it."""
    spec = PRESETS[preset].replace(vocab_size=vocab)
    src = megatron_layout(spec, MegatronParallel(tp=tp))
    dst = engine_layout(spec, EngineParallel(tp=tp))
    return spec, build_plan(src, dst)


ALIGNED = [("tiny-qwen3", 1), ("tiny-qwen3", 2), ("tiny-qwen2", 2), ("tiny-llama", 2), ("tiny-llama", 4)]


MATMULS = {"mlp.gate_up_proj.weight": "mlp.linear_fc1.weight",
           "mlp.down_proj.weight": "mlp.linear_fc2.weight",
           "self_attn.o_proj.weight": "self_attention.linear_proj.weight"}


def copies_by_dst(plan) -> dict:
    out = defaultdict(list)
    for c in plan.copies:
        out[(c.dst, c.dst_local)].append(c)
    return out


@pytest.mark.parametrize(("preset", "tp"), ALIGNED)
def test_aligned_tp_matmuls_move_rank_to_rank_unchanged(preset: str, tp: int) -> None:
    """fc1/fc2/linear_proj: trainer rank r's tensor lands unchanged on engine rank r."""
    spec, plan = aligned_plan(preset, tp)
    by_dst = copies_by_dst(plan)
    for r in range(tp):
        for layer in range(spec.num_layers):
            for eng, meg in MATMULS.items():
                name = f"model.layers.{layer}.{eng}"
                copies = by_dst[(r, name)]
                assert {(c.src, c.src_local) for c in copies} == {(r, f"decoder.layers.{layer}.{meg}")}
                assert all(c.src_offsets == c.dst_offsets for c in copies), "not an identity copy"
                assert sum(c.numel for c in copies) == plan.dst.ranks[r].tensor(name).numel
                # fc1 is gate + up: see test_aligned_tp_fc1_moves_without_pack_copy
                if eng != "mlp.gate_up_proj.weight":
                    (c,) = copies
                    assert plan.is_whole(c) == (True, True), c
        # Vp = Vp' here (LAYOUTS.md §6.4), so the embedding shard moves whole as well.
        (c,) = by_dst[(r, "model.embed_tokens.weight")]
        assert (c.src, c.src_local) == (r, "embedding.word_embeddings.weight")
        assert plan.is_whole(c) == (True, True)


def test_aligned_tp_fc1_moves_without_pack_copy() -> None:
    """The plan keeps gate and up as two copies; the compiled steps fuse them into one
    binding covering the whole local tensor on both ends, so no pack/unpack copy happens."""
    from shardsync.layout import EngineParallel
    from shardsync.runtime.schedule import p2p_steps
    from shardsync.topology import Topology

    spec = PRESETS["tiny-qwen3"].replace(vocab_size=1024)
    topo = Topology(spec, MegatronParallel(tp=2), (EngineParallel(tp=2),))
    name_src, name_dst = "decoder.layers.0.mlp.linear_fc1.weight", "model.layers.0.mlp.gate_up_proj.weight"
    for r in range(2):
        send = [b for s in p2p_steps(topo, r, 2**30) for b in s.pack if b.key == name_src]
        recv = [b for s in p2p_steps(topo, 2 + r, 2**30) for b in s.drain if b.key == name_dst]
        shape = topo.trainer_layout.ranks[r].tensor(name_src).shape
        for bindings in (send, recv):
            assert len(bindings) == 1
            assert bindings[0].box == shape and all(sl.start == 0 for sl in bindings[0].region)


def expected_qkv_permutation(spec: ModelSpec, tp: int) -> dict[int, int]:
    """Engine local row -> Megatron local row for t = t' <= ng (LAYOUTS.md §9.1 table)."""
    d, p = spec.head_dim, spec.heads_per_group
    groups, heads = spec.num_kv_heads // tp, spec.num_heads // tp
    out = {}
    for a in range(groups):
        for s in range(p + 2):
            for j in range(d):
                m = (a * (p + 2) + s) * d + j
                if s < p:
                    e = (a * p + s) * d + j
                elif s == p:
                    e = heads * d + a * d + j
                else:
                    e = heads * d + groups * d + a * d + j
                out[e] = m
    return out


@pytest.mark.parametrize(("preset", "tp"), ALIGNED)
def test_aligned_tp_qkv_is_a_rank_local_row_permutation(preset: str, tp: int) -> None:
    spec, plan = aligned_plan(preset, tp)
    want = expected_qkv_permutation(spec, tp)
    rows = len(want)
    suffixes = ("weight", "bias") if spec.qkv_bias else ("weight",)
    seen = defaultdict(dict)  # (engine rank, layer, suffix) -> engine row -> megatron row
    for c in plan.copies:
        if ".qkv_proj." not in c.dst_local:
            continue
        suffix = c.dst_local.rsplit(".", 1)[1]
        layer = layer_of(c.dst_local)
        assert c.src == c.dst, f"cross-rank QKV traffic: {c}"
        assert c.src_local == f"decoder.layers.{layer}.self_attention.linear_qkv.{suffix}"
        assert c.sizes[1:] == plan.dst.ranks[c.dst].tensor(c.dst_local).shape[1:], "partial rows"
        assert c.src_offsets[1:] == c.dst_offsets[1:] == (0,) * (len(c.sizes) - 1)
        rows_of = seen[(c.dst, layer, suffix)]
        for i in range(c.sizes[0]):
            assert c.dst_offsets[0] + i not in rows_of, "engine row written twice"
            rows_of[c.dst_offsets[0] + i] = c.src_offsets[0] + i
    assert set(seen) == {(r, n, s) for r in range(tp) for n in range(spec.num_layers) for s in suffixes}
    for key, rows_of in seen.items():
        assert sorted(rows_of.values()) == list(range(rows)), f"{key}: not a permutation"
        assert rows_of == want, key


def test_case_b_qkv_traffic_stays_inside_group_blocks() -> None:
    """t = t' > ng (LAYOUTS.md §9.2): group g's rows move only among ranks [g*t/ng, (g+1)*t/ng)."""
    spec = PRESETS["tiny-qwen3"]  # 8 heads, 2 kv heads
    tp, block = 4, 2
    plan = build_plan(megatron_layout(spec, MegatronParallel(tp=tp)),
                      engine_layout(spec, EngineParallel(tp=tp)))
    qkv = [c for c in plan.copies if ".qkv_proj." in c.dst_local]
    assert qkv and all(c.src // block == c.dst // block for c in qkv)
    assert any(c.src != c.dst for c in qkv)  # storage is not head-aligned, so some rows move


def test_qwen3_4b_p2p_busiest_link_is_a_quarter_of_broadcast() -> None:
    topo = Topology(PRESETS["Qwen3-4B"], MegatronParallel(tp=4), (EngineParallel(tp=4),))
    (_, busiest) = topo.p2p_plan.busiest_link()
    per_receiver = max(topo.broadcast_plan.bytes_per_dst().values())
    ratio = busiest / per_receiver
    print(f"Qwen3-4B TP4->TP4: busiest p2p link {busiest / 2**20:.1f} MiB, broadcast per "
          f"receiver {per_receiver / 2**20:.1f} MiB, ratio {ratio:.4f}")
    assert 0.24 < ratio < 0.26


# ---------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------

def without(layout: Layout, logical: str, ranks: set[int] | None = None) -> Layout:
    """``layout`` with every piece of ``logical`` dropped (on ``ranks``, default all)."""
    out = tuple(
        RankLayout(rl.label, rl.tensors,
                   tuple(p for p in rl.pieces
                         if p.logical != logical or (ranks is not None and i not in ranks)))
        for i, rl in enumerate(layout.ranks))
    return Layout(layout.kind, layout.spec, layout.logical, out, layout.params)


def test_plan_names_a_tensor_missing_from_the_source() -> None:
    spec = PRESETS["tiny-qwen3"]
    name = "model.layers.1.mlp.up_proj.weight"
    src = without(megatron_layout(spec, MegatronParallel(tp=2)), name)
    with pytest.raises(PlanError, match="missing") as err:
        build_plan(src, engine_layout(spec, EngineParallel(tp=2)))
    assert name in str(err.value)
    assert "model.layers.1.mlp.gate_proj.weight" not in str(err.value)


def test_plan_names_a_region_missing_on_one_rank() -> None:
    spec = PRESETS["tiny-qwen3"]
    name = "model.layers.2.self_attn.k_proj.weight"
    src = without(megatron_layout(spec, MegatronParallel(tp=2)), name, ranks={1})
    with pytest.raises(PlanError, match="missing") as err:
        build_plan(src, engine_layout(spec, EngineParallel(tp=1)))
    assert name in str(err.value)


def test_plan_names_doubled_source_regions() -> None:
    """A whole tensor and its TP shards as sources overlap in different boxes: ambiguous."""
    spec = PRESETS["tiny-qwen3"]
    src = concat_layouts("mixed", [full_layout(spec), megatron_layout(spec, MegatronParallel(tp=2))])
    with pytest.raises(PlanError, match="doubled") as err:
        build_plan(src, engine_layout(spec, EngineParallel(tp=2)))
    assert "model.layers.0.self_attn.q_proj.weight" in str(err.value)


def test_plan_refuses_different_models() -> None:
    a, b = PRESETS["tiny-qwen3"], PRESETS["tiny-qwen2"]
    with pytest.raises(PlanError, match="different models"):
        build_plan(full_layout(a), engine_layout(b, EngineParallel(tp=1)))


# ---------------------------------------------------------------------------------------
# Invalid configs name the constraint
# ---------------------------------------------------------------------------------------

TINY = PRESETS["tiny-qwen3"]  # 8 heads, 2 kv heads, ffn 512, 4 layers


@pytest.mark.parametrize(("spec", "par", "pattern"), [
    (TINY, MegatronParallel(tp=3), r"num_heads=8 not divisible by tp=3"),
    (TINY.replace(num_heads=12, num_kv_heads=3), MegatronParallel(tp=2),
     r"tp=2 must divide or be a multiple of num_kv_heads=3"),
    (TINY.replace(intermediate_size=510), MegatronParallel(tp=4),
     r"intermediate_size=510 not divisible by tp=4"),
    (TINY, MegatronParallel(pp=3), r"num_layers=4 is not divisible by pp=3"),
    (TINY, MegatronParallel(pp=2, pp_layers=(1, 2)), r"pp_layers=\(1, 2\).*summing to num_layers=4"),
    (TINY, MegatronParallel(norm_names="te"), r"norm_names must be one of"),
])
def test_invalid_megatron_config_names_the_constraint(spec, par, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        megatron_layout(spec, par)


@pytest.mark.parametrize(("spec", "tp", "pattern"), [
    (TINY, 3, r"num_heads=8 not divisible by tp=3"),
    (TINY.replace(num_heads=12, num_kv_heads=3), 2, r"tp=2 must divide or be a multiple of num_kv_heads=3"),
    (TINY.replace(intermediate_size=510), 4, r"intermediate_size=510 not divisible by tp=4"),
])
def test_invalid_engine_config_names_the_constraint(spec, tp, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        engine_layout(spec, EngineParallel(tp=tp))


def test_megatron_refuses_tp_that_does_not_split_fused_qkv_rows() -> None:
    # h=8, ng=1, d=2: (8 + 2) * 2 = 20 fused rows, tp=8 -> 2.5 rows per rank.
    spec = TINY.replace(num_heads=8, num_kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="tp=8"):
        megatron_layout(spec, MegatronParallel(tp=8))


def test_a_plan_builds_with_the_cyclic_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its ~10^6 small objects would be scanned again and again (``gcpause``): a decorator lost
    in an edit costs Qwen3-30B-A3B's plan 0.7 s (``benchmarks/plan_build.py``)."""
    import gc

    from shardsync.plan import plan as plan_module

    seen: list[bool] = []

    class Spy(plan_module.Reader):
        def __init__(self, *args, **kwargs) -> None:
            seen.append(gc.isenabled())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(plan_module, "Reader", Spy)
    spec = PRESETS["tiny-qwen3"]
    assert gc.isenabled()
    build_plan(megatron_layout(spec, MegatronParallel(tp=2)), engine_layout(spec, EngineParallel(tp=1)))
    assert seen == [False] and gc.isenabled()
