"""FP8 on the wire (``quant/wire.py``): which weights a topology sends quantized, and the plans
that carry them: every engine FP8 tensor and scale covered exactly once (``build_plan`` proves
coverage), <= 0.55x of a bf16 engine's bytes, only the blocks a trainer shard cuts wide."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.layout.fsdp2 import Fsdp2Parallel
from shardsync.piece import Role
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format
from shardsync.quant.wire import DERIVED, PER_WORD, WIDE, WORD, cells, wide_copies
from shardsync.topology import Topology
from shardsync.views import Host, views_of
from tests.fp8_straddle import STRADDLE

DENSE, MOE, MLA = PRESETS["tiny-qwen3-fp8"], PRESETS["tiny-qwen3-moe-fp8"], PRESETS["tiny-deepseek-v3-fp8"]
TRAINERS = {
    "tp1": MegatronParallel(tp=1),
    "tp2": MegatronParallel(tp=2),
    "tp2ep2": MegatronParallel(tp=2, ep=2, etp=1),
    "fsdp2": Fsdp2Parallel(shard=2),
}
ENGINES = {"tp1": EngineParallel(tp=1), "tp2": EngineParallel(tp=2), "tp4": EngineParallel(tp=4),
           "tp2ep2": EngineParallel(tp=2, ep=2)}


def _topo(spec, trainer, engine, fmt: str | None = "fp8") -> Topology:
    return Topology(spec, trainer, (dataclasses.replace(engine, dtype=spec.dtype),), views=views_of(fmt))


def _targets(topo: Topology) -> set[str]:
    """The logical weights in the engine's FP8 tensors (its own layout)."""
    return {p.logical for r in topo.engine_bases[0].ranks for p in r.pieces if r.tensor(p.local).fp8}


# expert parallelism only where there are experts; MLA's shared expert (256 rows) is whole
# blocks up to engine TP 2, and an FSDP2 row split cuts its 192-row kv_a_proj
CASES = [(spec, t, e) for spec in (DENSE, MOE) for t in TRAINERS for e in ENGINES
         if spec.is_moe or "ep" not in t + e]
CASES += [(MLA, t, e) for t in ("tp1", "tp2", "tp2ep2") for e in ("tp1", "tp2", "tp2ep2")]
# sparse attention (the indexer replicated) and gated DeltaNet (the trainer holds it whole)
CASES += [(PRESETS[m], t, e) for m in ("tiny-deepseek-v32-fp8", "tiny-qwen3-next-fp8") for t in ("tp1", "tp2")
          for e in ("tp1", "tp2")]


@pytest.mark.parametrize(("spec", "trainer", "engine"), CASES, ids=lambda x: getattr(x, "name", x))
def test_whole_block_shards_send_every_weight_quantized_at_half_the_bytes(spec, trainer, engine) -> None:
    topo = _topo(spec, TRAINERS[trainer], ENGINES[engine])
    wide = _topo(spec, TRAINERS[trainer], ENGINES[engine], None)
    assert topo.fp8 is not None and topo.fp8.sent == _targets(topo)
    for mode in ("p2p", "broadcast"):
        plan, bf16 = (topo.p2p_plan, wide.p2p_plan) if mode == "p2p" else (topo.broadcast_plan, wide.broadcast_plan)
        assert plan.total_bytes <= 0.55 * bf16.total_bytes, (mode, plan.total_bytes / bf16.total_bytes)
    # every engine FP8 tensor holds e4m3 words whole, and its scale tensor is covered exactly once
    for rank in topo.engine_layouts[0].ranks:
        held = {t.name: t for t in rank.tensors}
        for t in rank.tensors:
            if t.dtype != WORD:
                continue
            scale = held[t.name + "_scale_inv"]
            for meta in (t, scale):
                assert sum(p.numel for p in rank.pieces if p.local == meta.name) == meta.numel, meta.name
            assert scale.stored[-1] == math.ceil(t.stored[-1] * PER_WORD / 128)
    # each trainer rank quantizes its regions; Megatron's interleaved QKV is assembled from parts
    derived = [d for r in range(topo.trainer.world_size) for d in topo.derived(r)]
    assert {d.logical for d in derived} == topo.fp8.sent and topo.fp8.split == {}
    assert all(d.words == DERIVED + d.logical for d in derived)
    if trainer == "tp2" and spec in (DENSE, MOE):
        assert any(len(d.parts) > 1 for d in derived if d.logical.endswith("q_proj.weight"))


@pytest.mark.parametrize("trainer", ["tp2", "fsdp2"])
def test_only_the_blocks_a_shard_cuts_move_wide(trainer: str) -> None:
    # 6 query heads and 2 KV heads of 64: a TP 2 trainer holds 192 query and 64 key rows per
    # rank (an FSDP2 one the same query rows), cutting the second of q_proj's three 128-row blocks
    spec = STRADDLE
    topo = _topo(spec, TRAINERS[trainer], ENGINES["tp1"])
    wide = _topo(spec, TRAINERS[trainer], ENGINES["tp1"], None)
    assert topo.fp8 is not None
    q = "model.layers.0.self_attn.q_proj.weight"
    assert {n.rsplit(".", 2)[-2] for n in topo.fp8.sent} >= {"gate_proj", "up_proj"}
    assert [(c.offsets, c.sizes, c.quantized) for c in topo.fp8.split[q]] == [
        ((0, 0), (128, 256), True), ((128, 0), (128, 256), False), ((256, 0), (128, 256), True)]
    k = "model.layers.0.self_attn.k_proj.weight"  # 128 rows cut at 64: no whole block, all wide
    assert k not in topo.fp8.sent and k not in topo.fp8.split
    rank = topo.engine_layouts[0].ranks[0]
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert rank.tensor(qkv).dtype == WORD and rank.tensor(qkv).role is Role.WORDS
    assert rank.tensor(qkv + "_scale_inv").role is Role.SCALES and rank.tensor(qkv + "_scale_inv").parent == qkv
    # q's middle block rows, k and v arrive wide, each into a twin of its box alone (a model-dtype
    # copy of just those rows); the scales of q's whole blocks only travel
    twins = {t.name: t for t in rank.tensors if t.name.startswith(qkv + WIDE)}
    assert sorted(twins) == [qkv + WIDE + "[128:256,0:256]", qkv + WIDE + "[384:512,0:256]",
                             qkv + WIDE + "[512:640,0:256]"]
    assert all(t.dtype == spec.dtype and t.shape == (128, 256) for t in twins.values())
    # what a twin stands for is in its fields: the tensor and the box's offsets (its sizes: its shape)
    assert [(t.role, t.parent, t.at) for _, t in sorted(twins.items())][0] == (Role.TWIN, qkv, (128, 0))
    assert sorted((p.logical.rsplit(".", 1)[-1], p.local, p.local_offsets) for n in twins
                  for p in rank.pieces_of(n)) == [
        ("weight", qkv + WIDE + "[384:512,0:256]", (0, 0)), ("weight", qkv + WIDE + "[512:640,0:256]", (0, 0)),
        ("weight[128:256,0:256]", qkv + WIDE + "[128:256,0:256]", (0, 0))]
    # what the rank keeps in bf16 beside what it serves: those boxes (and at TP 2 o_proj's middle
    # block columns; FSDP2's row halves of o_proj are whole blocks), not the whole tensors
    mixed = {t.parent for t in rank.tensors if t.role is Role.TWIN}
    o_proj = 256 * 128 if trainer == "tp2" else 0
    assert wide_copies(rank) == spec.num_layers * (3 * 128 * 256 + o_proj)
    assert wide_copies(rank) <= 0.6 * sum(PER_WORD * rank.tensor(n).numel for n in mixed)
    assert f"keeping {wide_copies(rank) * 2 / 2**20:.2f} MiB" in topo.fp8.summary(topo.engine_layouts, 2)
    assert sum(p.numel for p in rank.pieces_of(qkv + "_scale_inv")) == 2 * 2
    assert sum(p.numel for p in rank.pieces_of(qkv)) == 256 * 256 // PER_WORD
    # each trainer rank quantizes the whole cells in its shard (rank 0 the first, rank 1 the last)
    names = [sorted(d.logical for d in topo.derived(r) if d.logical.startswith(q)) for r in range(2)]
    assert names == [[q + "[0:128,0:256]"], [q + "[256:384,0:256]"]]
    assert all(d.at == (0, 0) and d.offsets[0] == int(d.logical[len(q) + 1:].split(":")[0])
               for r in range(2) for d in topo.derived(r) if d.logical.startswith(q))
    for mode in ("p2p", "broadcast"):  # the plans build (coverage proven) and move fewer bytes
        plan, bf16 = (topo.p2p_plan, wide.p2p_plan) if mode == "p2p" else (topo.broadcast_plan, wide.broadcast_plan)
        assert plan.total_bytes < 0.7 * bf16.total_bytes, mode
    # the same shapes from a TP 1 trainer: every block whole, nothing cut
    whole = _topo(spec, MegatronParallel(tp=1), ENGINES["tp1"]).fp8
    assert whole is not None and whole.split == {} and whole.sent > topo.fp8.sent


def test_cells_cut_at_the_blocks_around_each_trainer_edge() -> None:
    fmt = fp8_format("fp8")
    grid = cells("w", (384, 300), [((0, 0), (100, 300)), ((100, 0), (284, 300))], fmt)
    assert [(c.offsets, c.sizes, c.quantized) for c in grid] == [
        ((0, 0), (128, 256), False), ((0, 256), (128, 44), False),  # the edge at row 100 crosses rows 0:128
        ((128, 0), (256, 256), True), ((128, 256), (256, 44), True)]  # 44 columns: the matrix's last block
    assert not any(c.quantized for c in cells("w", (384, 302), [((128, 0), (256, 302))], fmt)[-1:])  # 302: no words
    assert all(c.quantized for c in cells("w", (256, 256), [((0, 0), (128, 256)), ((128, 0), (128, 256))], fmt))


def test_per_channel_scales_of_a_column_shard_are_its_own() -> None:
    topo = _topo(DENSE, MegatronParallel(tp=1), EngineParallel(tp=2), "fp8-channel")
    assert topo.fp8 is not None
    kinds = {n.rsplit(".", 2)[-2] for n in topo.fp8.sent}
    assert kinds == {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}  # row-parallel o/down: wide
    scale = topo.engine_layouts[0].ranks[0].tensor("model.layers.0.self_attn.qkv_proj.weight_scale")
    assert scale.shape[-1] == 1


def test_unquantized_and_engine_quantizing_topologies_plan_as_before() -> None:
    plain = _topo(DENSE, MegatronParallel(tp=2), EngineParallel(tp=2), None)
    assert plain.fp8 is None and plain.trainer_layout is plain.trainer_base
    hosted = dataclasses.replace(_topo(DENSE, MegatronParallel(tp=2), EngineParallel(tp=2)), host=Host("vllm"))
    assert hosted.fp8 is None  # an engine without shardsync's receiver loads whole tensors
    sglang = dataclasses.replace(hosted, host=Host("sglang"))  # its host writes SGLang's FP8 parameters
    assert sglang.fp8 is not None and sglang.fp8.sent
