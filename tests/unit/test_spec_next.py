"""Gated DeltaNet hybrids (Qwen3-Next): the preset against the published size, logical tensors
against transformers' class, the config round trip, and what each side holds of the tensors
whose order is the trap: the group-interleaved ``in_proj_qkvz`` / ``in_proj_ba`` (engines: whole
groups in checkpoint order), the conv channels (``[q | k | v]`` of a rank's heads), the gated
``q_proj`` (engines keep each head's [query; gate]; Megatron's groups hold queries, then gates).
The rows each engine rank holds are the ones SGLang 0.5.23 and vLLM 0.32 were seen to hold
(docs/notes/qwen3_next_engines.md, section 5); ``tests/sglang`` checks them against SGLang's load."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardsync.family.section import Linear
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout, megatron_layout
from shardsync.layout.logical import model_tensors
from shardsync.plan.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.spec import spec_from_config

TINY = PRESETS["tiny-qwen3-next"]
TINY35 = PRESETS["tiny-qwen3.5-moe"]
L0, L3 = "model.layers.0.", "model.layers.3."


def _rows(rank, local: str, logical: str) -> list[int]:
    """The logical rows (dim 0) ``rank``'s ``local`` tensor holds from ``logical``, in local order."""
    pieces = sorted((p for p in rank.pieces if p.local == local and p.logical == logical),
                    key=lambda p: p.local_offsets[0])
    return [r for p in pieces for r in range(p.offsets[0], p.offsets[0] + p.sizes[0])]


@pytest.mark.parametrize(("name", "billions"), [("Qwen3-Next-80B-A3B", 79.7), ("Qwen3.5-35B-A3B", 34.7)])
def test_presets_have_the_published_size(name: str, billions: float) -> None:
    assert abs(PRESETS[name].num_parameters() / 1e9 - billions) < 0.1  # "80B", "35B"


def test_qwen35_preset_is_transformers_defaults() -> None:
    import transformers

    theirs = spec_from_config(transformers.AutoConfig.for_model("qwen3_5_moe_text").to_dict(), "x")
    ours = PRESETS["Qwen3.5-35B-A3B"]
    # transformers has no MTP field; the released config.json says ``mtp_num_hidden_layers: 1``
    assert theirs.replace(name=ours.name, rope_theta=ours.rope_theta, num_nextn_predict_layers=1,
                          max_position_embeddings=ours.max_position_embeddings, dtype=ours.dtype) == ours


@pytest.mark.parametrize(("spec", "arch"), [(TINY, "Qwen3NextForCausalLM"), (TINY35, "Qwen3_5MoeForCausalLM")],
                         ids=lambda x: getattr(x, "name", x))
def test_logical_tensors_are_transformers_tensors(spec, arch: str) -> None:
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == arch
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()
              if not n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))}
    ours = {n: s for n, s in model_tensors(spec).items() if ".mlp.experts." not in n}
    assert ours == theirs
    assert sum(".mlp.experts." in n for n in model_tensors(spec)) == 3 * spec.num_experts * spec.num_layers


def test_config_round_trip_and_layer_types() -> None:
    for spec in (TINY, PRESETS["Qwen3-Next-80B-A3B"], TINY35, PRESETS["Qwen3.5-35B-A3B"]):
        assert spec_from_config(spec.to_hf_config(), spec.name) == spec
    bad = {**TINY.to_hf_config(), "layer_types": ["linear_attention", "full_attention"] * 2}
    assert spec_from_config(bad, "x").section(Linear).full_attention_interval == 2  # an interval: read as one
    bad["layer_types"] = ["full_attention", "linear_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="full_attention_interval only"):
        spec_from_config(bad, "x")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_engine_ranks_hold_whole_groups_in_checkpoint_order(tp: int) -> None:
    spec = TINY
    lay = engine_layout(spec, EngineParallel(tp=tp))
    build_plan(full_layout(spec), lay)  # every held element written exactly once
    nk, nv, dk, dv = 4, 8, 32, 32
    group, lq, lv = 2 * dk + 2 * (nv // nk) * dv, nk * dk, nv * dv
    a = L0 + "linear_attn."
    for r, rank in enumerate(lay.ranks):
        qkvz = _rows(rank, a + "in_proj_qkvz.weight", a + "in_proj_qkvz.weight")
        assert qkvz == list(range(r * nk // tp * group, (r + 1) * nk // tp * group))  # its groups, interleaved
        conv = _rows(rank, a + "conv1d.weight", a + "conv1d.weight")
        q, v = lq // tp, lv // tp
        assert conv == [*range(r * q, (r + 1) * q), *range(lq + r * q, lq + (r + 1) * q),
                        *range(2 * lq + r * v, 2 * lq + (r + 1) * v)]
        assert rank.tensor(a + "A_log").dtype == "float32"
        qkv = _rows(rank, L3 + "qkv_proj.weight", L3 + "self_attn.q_proj.weight")
        h = spec.num_heads // tp  # each head's query then gate, as q_proj holds them
        assert qkv == list(range(r * h * 2 * spec.head_dim, (r + 1) * h * 2 * spec.head_dim))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen35_engine_ranks_stack_their_heads_of_each_projection(tp: int) -> None:
    """Qwen3.5's checkpoint keeps q, k, v (one tensor), z, b and a apart: a rank stacks its heads'
    rows of each, ``[q | k | v | z]`` and ``[b | a]``."""
    lay = engine_layout(TINY35, EngineParallel(tp=tp))
    build_plan(full_layout(TINY35), lay)
    a = L0 + "linear_attn."
    lq, lv, nv = 4 * 32, 8 * 32, 8
    for r, rank in enumerate(lay.ranks):
        q, v = lq // tp, lv // tp
        assert _rows(rank, a + "in_proj_qkvz.weight", a + "in_proj_qkv.weight") == [
            *range(r * q, (r + 1) * q), *range(lq + r * q, lq + (r + 1) * q),
            *range(2 * lq + r * v, 2 * lq + (r + 1) * v)]
        assert _rows(rank, a + "in_proj_qkvz.weight", a + "in_proj_z.weight") == list(range(r * v, (r + 1) * v))
        b = nv // tp
        assert _rows(rank, a + "in_proj_ba.weight", a + "in_proj_a.weight") == list(range(r * b, (r + 1) * b))


def test_vllm_names_keep_self_attn_and_the_engines_refuse_split_heads() -> None:
    names = {t.name for t in engine_layout(TINY, EngineParallel(tp=2, variants=frozenset({"vllm"}))).ranks[0].tensors}
    assert {L3 + "self_attn.qkv_proj.weight", L3 + "self_attn.o_proj.weight"} <= names
    assert L3 + "qkv_proj.weight" not in names
    with pytest.raises(ValueError, match="linear attention's key heads"):
        engine_layout(TINY.replace(linear_num_key_heads=2, linear_num_value_heads=4), EngineParallel(tp=4))


def test_megatron_groups_hold_queries_then_gates_then_k_and_v() -> None:
    """megatron-core with ``attention_output_gate``: per KV group its q heads, their gates, k, v."""
    spec = TINY
    lay = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1))
    build_plan(lay, full_layout(spec))
    d, p = spec.head_dim, spec.num_heads // spec.num_kv_heads
    for g, rank in enumerate(lay.ranks):  # TP 2 = the 2 KV groups
        local = "decoder.layers.3.self_attention.linear_qkv.weight"
        q = _rows(rank, local, L3 + "self_attn.q_proj.weight")
        heads = range(g * p, (g + 1) * p)
        assert q == [*(r for i in heads for r in range(2 * d * i, 2 * d * i + d)),
                     *(r for i in heads for r in range(2 * d * i + d, 2 * d * (i + 1)))]
        held = {t.name for t in rank.tensors}
        assert "decoder.layers.0.self_attention.linear_attn.in_proj_qkvz.weight" in held  # slime's module, whole
        assert "decoder.layers.0.mlp.shared_experts.gate_weight" in held


def test_plan_cli_plans_qwen3_next_on_one_node() -> None:
    """One node: trainer TP2 EP8 (DP 4) -> an engine TP4 EP4 and another TP4 EP4."""
    out = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "plan", "--model", "Qwen3-Next-80B-A3B", "--trainer-tp", "2",
         "--trainer-dp", "4", "--trainer-ep", "8", "--trainer-etp", "1", "--engine-tp", "4", "--engine-ep", "4",
         "--engines", "2"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "p2p: available" in out.stdout, out.stdout[-2000:]
