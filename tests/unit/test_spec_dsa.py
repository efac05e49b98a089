"""DeepSeek sparse attention (GLM-5, DeepSeek-V3.2): presets against the published sizes and
transformers' own config defaults, logical tensors against transformers' classes (GLM-5's
shared layers included), the config round trip, the indexer's rows on every side (replicated,
SGLang's dtypes, the fused variants) and the plans."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardsync.family.section import Indexer, Latent
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout, megatron_layout
from shardsync.layout.logical import model_tensors
from shardsync.plan.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.spec import spec_from_config

TINY = ("tiny-glm5", "tiny-deepseek-v32")
IX = "model.layers.{}.self_attn.indexer."


def _hf_model(spec):
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize(("name", "billions"), [("GLM-5", 743.9), ("DeepSeek-V3.2", 671.9)])
def test_dsa_presets_have_the_published_size(name: str, billions: float) -> None:
    """GLM-5's card: 744 B; DeepSeek-V3.2: DeepSeek-V3's 671 B plus ~0.9 B of indexers (MTP not counted)."""
    assert abs(PRESETS[name].num_parameters() / 1e9 - billions) < 0.1


@pytest.mark.parametrize(("name", "model_type"), [("GLM-5", "glm_moe_dsa"), ("DeepSeek-V3.2", "deepseek_v32")])
def test_presets_agree_with_transformers_config_defaults(name: str, model_type: str) -> None:
    """transformers' config classes default to the published models' numbers."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type).to_dict()
    theirs, ours = spec_from_config(cfg, name), PRESETS[name]
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "vocab_size", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers",
                "routed_scaling_factor", "sections"):  # sections: the latent and the indexer numbers
        assert getattr(theirs, key) == getattr(ours, key), key


@pytest.mark.parametrize("name", TINY)
def test_logical_tensors_are_transformers_tensors(name: str) -> None:
    """Every indexer tensor (``k_norm`` with its bias) on every layer, experts compared per element
    as for DeepSeek-V3 (transformers stacks them)."""
    spec = PRESETS[name]
    model = _hf_model(spec)
    assert type(model).__name__ == spec.architecture
    theirs = {n: tuple(t.shape) for n, t in model.state_dict().items()
              if not n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))}
    ours = {n: s for n, s in model_tensors(spec).items() if ".mlp.experts." not in n}
    assert ours == theirs
    n, d = spec.section(Indexer).index_n_heads, spec.section(Indexer).index_head_dim
    assert ours[IX.format(1) + "wq_b.weight"] == (n * d, spec.section(Latent).q_lora_rank)
    assert ours[IX.format(1) + "k_norm.bias"] == (d,)
    assert ours[IX.format(1) + "weights_proj.weight"] == (n, spec.hidden_size)


def test_glm5_shared_layers_hold_no_indexer() -> None:
    """GLM-5 may let a layer reuse the choice of the layer before (``indexer_types`` "shared"):
    that layer has no indexer tensors, in transformers and here, and the config round-trips."""
    spec = PRESETS["tiny-glm5"].replace(index_shared_layers=(2, 3))
    ours = model_tensors(spec)
    assert {n for n in ours if ".indexer." in n} == {n for n in _hf_model(spec).state_dict() if ".indexer." in n}
    assert [any(n.startswith(IX.format(i)) for n in ours) for i in range(4)] == [True, True, False, False]
    assert spec_from_config(spec.to_hf_config(), spec.name) == spec
    freq = {**spec.to_hf_config(), "index_topk_freq": 2, "index_skip_topk_offset": 1}
    del freq["indexer_types"]
    assert spec_from_config(freq, "x").section(Indexer).index_shared_layers == (1, 3)  # transformers' schedule


@pytest.mark.parametrize(("change", "match"), [
    ({"indexer_types": ["shared", "full", "full", "full"]}, "first layer must be 'full'"),
    ({"indexer_types": ["full", "sparse", "full", "full"]}, "'full' or 'shared'"),
    ({"index_kpool": 4}, "key pool"),
])
def test_bad_indexer_configs_are_refused_with_the_reason(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        spec_from_config({**PRESETS["tiny-glm5"].to_hf_config(), **change}, "bad")


def test_deepseek_v32_refuses_shared_layers() -> None:
    with pytest.raises(ValueError, match="every layer"):
        PRESETS["tiny-deepseek-v32"].replace(index_shared_layers=(2,))


@pytest.mark.parametrize("name", [*TINY, "GLM-5", "GLM-5-4layer", "DeepSeek-V3.2"])
def test_config_round_trip_keeps_the_indexer(name: str) -> None:
    spec = PRESETS[name]
    assert spec_from_config(spec.to_hf_config(), name=spec.name) == spec


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (4, 2)])
def test_engine_holds_the_indexer_whole_in_sglangs_dtypes(name: str, tp: int, ep: int) -> None:
    """SGLang replicates the indexer; ``weights_proj`` is bfloat16 and ``k_norm`` float32 whatever
    the model's dtype; every held element written exactly once."""
    spec = PRESETS[name].replace(dtype="bfloat16")
    lay = engine_layout(spec, EngineParallel(tp=tp, ep=ep))
    build_plan(full_layout(spec), lay)
    for rank in lay.ranks:
        held = {t.name: (t.shape, t.dtype) for t in rank.tensors}
        ix = IX.format(1)
        n, d = spec.section(Indexer).index_n_heads, spec.section(Indexer).index_head_dim
        assert held[ix + "wq_b.weight"] == ((n * d, spec.section(Latent).q_lora_rank), "bfloat16")
        assert held[ix + "weights_proj.weight"] == ((n, spec.hidden_size), "bfloat16")
        assert held[ix + "k_norm.bias"] == ((d,), "float32")


@pytest.mark.parametrize("variant,dtype", [("indexer_fused", "bfloat16"), ("vllm", "float32")])
def test_fused_indexer_key_is_wk_then_weights_proj(variant: str, dtype: str) -> None:
    """SGLang on CUDA (GLM-5) and vLLM hold ``wk_weights_proj`` = [wk; weights_proj]: SGLang in
    bfloat16, vLLM in the model's dtype."""
    spec = PRESETS["tiny-glm5"]
    lay = engine_layout(spec, EngineParallel(tp=2, variants=frozenset({variant})))
    build_plan(full_layout(spec), lay)
    ix = IX.format(1)
    rank = lay.ranks[1]
    assert rank.tensor(ix + "wk_weights_proj.weight").dtype == dtype
    assert not any(t.name in (ix + "wk.weight", ix + "weights_proj.weight") for t in rank.tensors)
    pieces = [(p.logical.removeprefix(ix), p.local_offsets[0], p.sizes[0]) for p in rank.pieces
              if p.local == ix + "wk_weights_proj.weight"]
    d = spec.section(Indexer).index_head_dim
    assert pieces == [("wk.weight", 0, d), ("weights_proj.weight", d, spec.section(Indexer).index_n_heads)]


@pytest.mark.parametrize("norm_names", ["fused", "separate"])
def test_megatron_holds_the_indexer_replicated_under_core_attention(norm_names: str) -> None:
    spec = PRESETS["tiny-glm5"]
    lay = megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1, norm_names=norm_names))
    build_plan(lay, full_layout(spec))
    a = "decoder.layers.1.self_attention.core_attention.indexer."
    for rank in lay.ranks:
        shapes = {t.name: t.shape for t in rank.tensors}
        n, d = spec.section(Indexer).index_n_heads, spec.section(Indexer).index_head_dim
        assert shapes[a + "linear_wq_b.weight"] == (n * d, spec.section(Latent).q_lora_rank)
        assert shapes[a + "linear_weights_proj.weight"] == (n, spec.hidden_size)
        assert shapes[a + "k_norm.bias"] == (d,)


def test_plan_cli_plans_glm5_p2p_as_the_examples_run_it() -> None:
    """16 + 16 nodes: trainer TP4 PP4 EP32 (DP 8; the last stage 18 layers) -> engines TP8 EP8, one per node
    (DeepSeek-V3.2's plan: benchmarks/plan_build.py)."""
    out = subprocess.run(
        [sys.executable, "-m", "shardsync.cli", "plan", "--model", "GLM-5", "--trainer-tp", "4", "--trainer-pp", "4",
         "--trainer-pp-layers", "20,20,20,18", "--trainer-dp", "8", "--trainer-ep", "32", "--trainer-etp", "1",
         "--engine-tp", "8", "--engine-ep", "8", "--engines", "16"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "p2p: available" in out.stdout, out.stdout[-2000:]
