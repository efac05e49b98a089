"""Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash): presets against the
published sizes, logical tensors against transformers' own classes built from the spec's
config, the config round trip, and the layouts every side holds."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardsync.family.section import Latent
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout, megatron_layout
from shardsync.layout.logical import logical_tensors, model_tensors
from shardsync.plan.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.spec import spec_from_config

TINY = ("tiny-deepseek-v3", "tiny-deepseek-v3-q-proj", "tiny-glm4-moe-lite")


@pytest.mark.parametrize(("name", "billions"), [("DeepSeek-V3", 671.0), ("Kimi-K2", 1026.4), ("GLM-4.7-Flash", 29.9)])
def test_mla_presets_have_the_published_size(name: str, billions: float) -> None:
    """Without the MTP layer (DeepSeek-V3's card: 671 B + 14 B MTP; Kimi-K2: 1 T)."""
    assert abs(PRESETS[name].num_parameters() / 1e9 - billions) < 0.1


@pytest.mark.parametrize("name", TINY)
def test_logical_tensors_are_transformers_tensors(name: str) -> None:
    """transformers 5 stacks each layer's experts ([E, 2I, H] and [E, H, I]) and keeps the
    router's score-correction bias as a buffer: compare the state dict, experts per element."""
    import transformers

    spec = PRESETS[name]
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == spec.architecture
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    stacked = {n: s for n, s in theirs.items() if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))}
    ours = model_tensors(spec)  # the MTP layers: test_mtp_layer_is_transformers_mtp_model
    experts = {n: s for n, s in ours.items() if ".mlp.experts." in n}
    assert {n: s for n, s in ours.items() if n not in experts} == {n: s for n, s in theirs.items() if n not in stacked}
    sparse = [n for n in range(spec.num_layers) if spec.sparse_layer(n)]
    assert sparse == list(range(1, spec.num_layers))  # first_k_dense_replace = 1
    E, Fe, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    for layer in sparse:
        p = f"model.layers.{layer}.mlp.experts."
        assert stacked[p + "gate_up_proj"] == (E, 2 * Fe, H) and stacked[p + "down_proj"] == (E, H, Fe)
        assert all(experts[f"{p}{e}.{x}_proj.weight"] == ((Fe, H) if x != "down" else (H, Fe))
                   for e in range(E) for x in ("gate", "up", "down"))
    assert len(experts) == 3 * E * len(sparse)


@pytest.mark.parametrize("name", ["tiny-deepseek-v3", "tiny-glm4-moe"])
def test_mtp_layer_is_transformers_mtp_model(name: str) -> None:
    """The checkpoint's MTP layer ``model.layers.{L}`` as transformers' ``MtpModel`` loads it
    (its checkpoint renames: the head's tensors stay, ``shared_head.norm`` is ``post_norm``,
    the decoder layer is ``mtp_block``); its embedding and head are the main model's.  Latent
    attention (DeepSeek-V3) and grouped-query attention (GLM-4.5's MTP layer)."""
    import transformers
    from transformers.modeling_layers import MtpModel

    spec = PRESETS[name].replace(num_nextn_predict_layers=1)
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    with torch.device("meta"):
        mtp = MtpModel(transformers.AutoModelForCausalLM.from_config(cfg), 1)
    theirs = {n: tuple(t.shape) for n, t in mtp.state_dict().items() if n.startswith("layers.")}
    prefix = f"model.layers.{spec.num_layers}."
    E, Fe, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    head = {"enorm.weight", "hnorm.weight", "eh_proj.weight"}

    def renamed(name: str) -> str:
        rest = name.removeprefix(prefix)
        return "layers.0." + (rest if rest in head else "post_norm.weight" if rest == "shared_head.norm.weight"
                              else "mtp_block." + rest)

    mine = {n: s for n, s in logical_tensors(spec).items() if n.startswith(prefix)}
    assert set(mine) == set(logical_tensors(spec)) - set(model_tensors(spec))
    experts = {n: s for n, s in mine.items() if ".mlp.experts." in n}
    assert len(experts) == 3 * E
    assert {renamed(n): s for n, s in mine.items() if n not in experts} == {
        n: s for n, s in theirs.items() if not n.endswith((".experts.gate_up_proj", ".experts.down_proj"))}
    assert theirs["layers.0.mtp_block.mlp.experts.gate_up_proj"] == (E, 2 * Fe, H)


@pytest.mark.parametrize("name", [*TINY, "DeepSeek-V3", "Kimi-K2", "GLM-4.7-Flash"])
def test_config_round_trip_keeps_the_latent_attention(name: str) -> None:
    spec = PRESETS[name]
    assert spec_from_config(spec.to_hf_config(), name=spec.name) == spec


def test_a_config_without_q_lora_rank_takes_q_proj() -> None:
    spec = PRESETS["tiny-deepseek-v3-q-proj"]
    names = logical_tensors(spec)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("q_a_proj" in n or "q_b_proj" in n for n in names)
    engine = {t.name for t in engine_layout(spec, EngineParallel(tp=2)).ranks[0].tensors}
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in engine  # not fused without q_lora
    assert not any("fused_qkv_a_proj" in n for n in engine)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 8)])
def test_engine_layout_splits_heads_and_keeps_the_down_projections_whole(name: str, tp: int, ep: int) -> None:
    spec = PRESETS[name]
    lay = engine_layout(spec, EngineParallel(tp=tp, ep=ep))
    build_plan(full_layout(spec), lay)  # every held element is written exactly once
    lat = spec.section(Latent)
    h, nope, rope, v = spec.num_heads // tp, lat.qk_nope_head_dim, lat.qk_rope_head_dim, lat.v_head_dim
    shapes = {t.name: t.shape for t in lay.ranks[tp - 1].tensors}
    a = "model.layers.1.self_attn."
    assert shapes[a + "kv_b_proj.weight"] == (h * (nope + v), lat.kv_lora_rank)
    assert shapes[a + "o_proj.weight"] == (spec.hidden_size, h * v)
    if lat.q_lora_rank is not None:
        assert shapes[a + "q_b_proj.weight"] == (h * (nope + rope), lat.q_lora_rank)
        fused = [p for p in lay.ranks[tp - 1].pieces if p.local == a + "fused_qkv_a_proj_with_mqa.weight"]
        assert [(p.logical.rsplit(".", 2)[1], p.local_offsets[0], p.sizes[0]) for p in fused] == [
            ("q_a_proj", 0, lat.q_lora_rank),
            ("kv_a_proj_with_mqa", lat.q_lora_rank, lat.kv_lora_rank + rope)]


@pytest.mark.parametrize("norm_names", ["separate", "fused"])
def test_megatron_variants_differ_only_where_megatron_core_specs_do(norm_names: str) -> None:
    """The local spec splits the down projections over TP and keeps separate q/kv norms; the
    TE spec duplicates them and fuses the norms into the up projections."""
    spec = PRESETS["tiny-deepseek-v3"]
    lay = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1, norm_names=norm_names))
    build_plan(lay, full_layout(spec))  # every logical element has a source
    shapes = {t.name: t.shape for t in lay.ranks[1].tensors}
    a = "decoder.layers.0.self_attention."
    lat = spec.section(Latent)
    assert lat.q_lora_rank is not None
    rows = lat.q_lora_rank if norm_names == "fused" else lat.q_lora_rank // 2
    assert shapes[a + "linear_q_down_proj.weight"] == (rows, spec.hidden_size)
    assert (a + "linear_q_up_proj.layer_norm_weight" in shapes) == (norm_names == "fused")
    assert (a + "q_layernorm.weight" in shapes) == (norm_names == "separate")
    assert shapes[a + "linear_kv_up_proj.weight"] == (
        spec.num_heads // 2 * (lat.qk_nope_head_dim + lat.v_head_dim), lat.kv_lora_rank)


def test_plan_cli_plans_glm47_flash_p2p() -> None:
    """GLM-4.7-Flash as published on one node: trainer TP4 EP8 -> engine TP4 EP4."""
    out = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "plan", "--model", "GLM-4.7-Flash", "--trainer-tp", "4",
         "--trainer-dp", "2", "--trainer-ep", "8", "--trainer-etp", "1", "--engine-tp", "4", "--engine-ep", "4"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "p2p: available" in out.stdout, out.stdout[-2000:]



def test_inconsistent_latent_dims_are_refused_with_the_rule() -> None:
    with pytest.raises(ValueError, match="head_dim = nope \\+ rope"):
        PRESETS["tiny-deepseek-v3"].replace(qk_rope_head_dim=8)
