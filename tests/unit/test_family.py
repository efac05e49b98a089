"""Model families as tables: the registry is consistent, a new family is a table and nothing
else, rows carry their own dtypes, a block refuses a kind its layout has no rule for, and a
family may declare a kind of its own."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar

import pytest

from shardsync.family import ARCHITECTURES, FAMILIES
from shardsync.family.blocks import GQA, MOE, gated_mlp
from shardsync.family.cut import Cut, Kind, Local
from shardsync.family.kinds import ExpertMlps, Split, Whole
from shardsync.family.section import Latent, Section
from shardsync.family.table import Attention, Block, Family, Row, Supports, T, Variant
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout, megatron_layout
from shardsync.layout.engine import ENGINE_VARIANTS
from shardsync.layout.logical import logical_tensors
from shardsync.lora import Lora, check_lora
from shardsync.models.engine_layers import ATTENTION as ENGINE_ATTENTION
from shardsync.models.trainer_layers import ATTENTION as TRAINER_ATTENTION
from shardsync.piece import Piece
from shardsync.plan.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.quant.targets import check_family
from shardsync.spec import ModelSpec, spec_from_config

TINY = {s.family: s for s in PRESETS.values() if s.name.startswith("tiny-")}


def test_every_family_has_a_tiny_preset_and_one_architecture() -> None:
    assert set(TINY) == set(FAMILIES)
    assert sorted(ARCHITECTURES.values()) == sorted(FAMILIES)
    for name, fam in FAMILIES.items():
        assert fam.name == name and ARCHITECTURES[fam.architecture] == name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_megatron_and_engine_row_reads_logical_tensors_that_exist(family: str) -> None:
    """Cutting a row whose source is not a logical tensor would raise: every layer of the
    tiny preset builds in both layouts, and both cover every logical element once."""
    spec = TINY[family]
    full = full_layout(spec)
    trainer = megatron_layout(spec, MegatronParallel(tp=2, ep=2 if spec.is_moe else 1, etp=1 if spec.is_moe else None))
    engine = engine_layout(spec, EngineParallel(tp=2, ep=2 if spec.is_moe else 1))
    for lay in (trainer, engine):
        plan = build_plan(lay, full)  # raises unless every logical element has a source
        assert sum(c.numel for c in plan.copies) == spec.num_parameters()


def _custom(monkeypatch: pytest.MonkeyPatch, fam: Family) -> None:
    monkeypatch.setitem(FAMILIES, fam.name, fam)
    monkeypatch.setitem(ARCHITECTURES, fam.architecture, fam.name)


def test_a_new_family_is_a_table_and_nothing_else(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family built from the shared blocks plans and round-trips its config without any
    layout code knowing its name."""
    fam = Family("qwen3_custom", "Qwen3CustomForCausalLM", GQA, gated_mlp(), MOE, qk_norm=True, qkv_bias=True,
                 read=FAMILIES["qwen3_moe"].read, write=FAMILIES["qwen3_moe"].write)
    _custom(monkeypatch, fam)
    spec = TINY["qwen3_moe"].replace(family="qwen3_custom")
    assert spec_from_config(spec.to_hf_config(), spec.name) == spec
    names = logical_tensors(spec)
    assert "model.layers.1.self_attn.q_proj.bias" in names and "model.layers.1.mlp.experts.7.up_proj.weight" in names
    trainer = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    assert build_plan(trainer, engine_layout(spec, EngineParallel(tp=2))).copies


def test_a_row_dtype_reaches_the_layouts_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    fp32_router = dataclasses.replace(MOE, engine=tuple(
        dataclasses.replace(r, dtype="float32") if r.name.startswith("mlp.gate.") else r for r in MOE.engine))
    base = FAMILIES["glm4_moe"]
    _custom(monkeypatch, dataclasses.replace(base, name="glm4_fp32_router", architecture="X", moe=fp32_router))
    spec = TINY["glm4_moe"].replace(family="glm4_fp32_router", dtype="bfloat16")
    rank = engine_layout(spec, EngineParallel(tp=2)).ranks[0]
    dtypes = {t.name: t.dtype for t in rank.tensors}
    assert dtypes["model.layers.1.mlp.gate.weight"] == "float32"
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtypes["model.layers.1.mlp.experts.w13_weight"] == "bfloat16"
    megatron = {t.name: t.dtype for t in megatron_layout(spec, MegatronParallel(tp=2)).ranks[0].tensors}
    # megatron-core keeps the expert bias (a buffer) in float32, everything else in the model dtype
    assert {n for n, d in megatron.items() if d != "bfloat16"} == {
        f"decoder.layers.{n}.mlp.router.expert_bias" for n in range(1, spec.num_layers)}


def test_a_block_refuses_a_kind_its_layout_has_no_rule_for() -> None:
    with pytest.raises(ValueError, match="ExpertMlps is cut by the megatron layout only, not in engine rows"):
        Block(logical=GQA.logical, megatron=GQA.megatron,
              engine=(*GQA.engine, Row("mlp.experts", ExpertMlps("a{e}", "b{e}", "c{e}"))))
    assert Block(logical=GQA.logical, megatron=(*GQA.megatron, Row("mlp.experts", ExpertMlps("a", "b", "c"))),
                 engine=GQA.engine).megatron[-1].kind.per_expert


def test_a_family_declares_its_own_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kind is open: a family module's own rule (here: a bias held by TP rank 0 alone) cuts in
    every layout that holds the row, with no change to a layout module."""

    @dataclass(frozen=True)
    class FirstRank(Kind):
        source: str

        def cut(self, row: str, name: str, c: Cut) -> list[Local]:
            src = c.hf + self.source
            shape = c.logical[src]
            zeros = (0,) * len(shape)
            return [Local(name, shape, [Piece(src, zeros, shape, name, zeros)])] if c.rank == 0 else []

    bias = "self_attn.o_proj.bias"
    odd = Block(logical=(*GQA.logical, T(bias, "H")),
                megatron=(*GQA.megatron, Row("self_attention.linear_proj.bias", FirstRank(bias))),
                engine=(*GQA.engine, Row(bias, FirstRank(bias))), kind=GQA.kind)
    _custom(monkeypatch, Family("odd", "OddForCausalLM", odd, gated_mlp()))
    spec = TINY["qwen3"].replace(family="odd")
    for lay in (megatron_layout(spec, MegatronParallel(tp=2)), engine_layout(spec, EngineParallel(tp=2))):
        lay.validate()
        held = [sum(p.logical.endswith(bias) for p in r.pieces) for r in lay.ranks]
        assert held == [spec.num_layers, 0], lay.kind
    plan = build_plan(megatron_layout(spec, MegatronParallel(tp=2)), engine_layout(spec, EngineParallel(tp=2)))
    moved = [c for d in range(plan.dst.world_size) for c in plan.copies_to(d) if c.logical.endswith(bias)]
    assert sorted((c.src, c.dst) for c in moved) == [(0, 0)] * spec.num_layers


def test_a_family_declares_its_own_section(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family's own numbers are a ``Section`` in its module: the spec holds it with no new
    field, reads and writes it with the config, sends it as JSON, and its ``dims`` shape the
    family's rows (here: GPT-OSS-like attention sinks, one per head, and a sliding window)."""

    @dataclass(frozen=True)
    class Sinks(Section):
        key: ClassVar[str] = "sinks_test"
        sliding_window: int

        def dims(self, spec: ModelSpec) -> dict[str, int]:
            return {"heads": spec.num_heads}

        def check(self, spec: ModelSpec) -> str | None:
            return None if self.sliding_window > 0 else "sliding_window must be positive"

    sinks = "self_attn.sinks"
    block = Block(logical=(*GQA.logical, T(sinks, "heads")), megatron=(*GQA.megatron, Row(sinks, Split())),
                  engine=(*GQA.engine, Row(sinks, Split())), kind=GQA.kind)
    _custom(monkeypatch, Family("sinky", "SinkyForCausalLM", block, gated_mlp(), sections=(Sinks,)))
    base = TINY["qwen3"]
    spec = ModelSpec.build(**{**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                              "family": "sinky", "sections": (), "sliding_window": 128})
    assert spec.section(Sinks).sliding_window == 128 and spec.find(Latent) is None
    cfg = spec.to_hf_config()
    assert cfg["sliding_window"] == 128 and spec_from_config(cfg, spec.name) == spec
    assert ModelSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.replace(sliding_window=64).section(Sinks).sliding_window == 64
    with pytest.raises(ValueError, match="sliding_window must be positive"):
        spec.replace(sliding_window=0)
    with pytest.raises(ValueError, match=r"holds the sections \['sinks_test'\], got \[\]"):
        spec.replace(sections=())
    lay = engine_layout(spec, EngineParallel(tp=2))
    assert {t.shape for t in lay.ranks[1].tensors if t.name.endswith(sinks)} == {(spec.num_heads // 2,)}


def test_a_spec_from_a_peer_names_what_it_refuses() -> None:
    d = TINY["glm_moe_dsa"].to_dict()
    with pytest.raises(ValueError, match=r"unknown model spec sections \['bogus'\]"):
        ModelSpec.from_dict({**d, "sections": {**d["sections"], "bogus": {}}})
    with pytest.raises(ValueError, match=r"unknown indexer section fields \['extra'\]"):
        ModelSpec.from_dict({**d, "sections": {**d["sections"], "indexer": {**d["sections"]["indexer"], "extra": 1}}})
    with pytest.raises(ValueError, match="must be an object of objects"):
        ModelSpec.from_dict({**d, "sections": [1, 2]})
    with pytest.raises(ValueError, match="unknown model spec fields"):
        ModelSpec.from_dict({**d, "kv_lora_rank": 4})  # a section's field sent flat


def test_a_variant_word_not_declared_fails_where_the_row_is_written() -> None:
    assert Row("x.weight", Whole(), variant="vllm", unless=("shared_fused", "indexer_fused")).variant == "vllm"
    with pytest.raises(ValueError, match="row x.weight's layout variant must be one of"):
        Row("x.weight", Whole(), variant="vlm")  # a typo would make the row vanish from every layout
    with pytest.raises(ValueError, match="got 'sharedfused'"):
        Row("x.weight", Whole(), unless=("indexer_fused", "sharedfused"))
    assert set(ENGINE_VARIANTS) <= {str(v) for v in Variant}


def test_every_attention_block_names_its_kind_and_the_views_it_supports() -> None:
    """Each kind is one word the reference models compute and the views read off the block:
    LoRA sits on grouped-query attention only, FP8 engines serve every kind the tables name."""
    blocks = {b for f in FAMILIES.values()
              for b in (f.attention, f.shared_attention, f.linear_attention) if b is not None}
    assert {b.kind for b in blocks} == set(Attention)
    assert set(ENGINE_ATTENTION) == set(TRAINER_ATTENTION) == set(Attention)
    assert {b.kind for b in blocks if Supports.ADAPTER in b.supports} == {Attention.GQA}
    assert all(Supports.FP8 in b.supports for b in blocks)
    mla = TINY["deepseek_v3"]
    with pytest.raises(ValueError, match="mla attention, whose block takes no LoRA adapter"):
        check_lora(mla, Lora(rank=4, alpha=8.0, targets=("q_proj",)))


def test_fp8_engines_refuse_a_block_that_does_not_declare_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = dataclasses.replace(GQA, supports=frozenset({Supports.ADAPTER}))
    _custom(monkeypatch, Family("no_fp8", "NoFp8ForCausalLM", plain, gated_mlp()))
    spec = TINY["qwen3"].replace(family="no_fp8")
    with pytest.raises(ValueError, match=r"this model has \['gqa'\] attention"):
        check_family(spec)
    check_family(TINY["qwen3"])  # the shared GQA block declares it
