"""Named model specs: each published model's numbers, read off its HuggingFace
``config.json`` (docs/models.md, "Presets"), and tiny CPU variants of every family for the
tests and the demo; ``load_spec`` resolves a preset name or a config path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardsync.family import FAMILIES
from shardsync.spec import ModelSpec, spec_from_config


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _yarn(factor: float, original: int, *, beta_fast: float, beta_slow: float) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0}


def _mla(q_lora: int | None, kv_lora: int, nope: int, rope: int, v: int, nextn: int = 0) -> dict[str, Any]:
    return {"q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v, "num_nextn_predict_layers": nextn}


def _dsa(heads: int, head_dim: int, topk: int) -> dict[str, Any]:
    return {"index_n_heads": heads, "index_head_dim": head_dim, "index_topk": topk}


def _sigmoid_moe(experts: int, top_k: int, inter: int, *, shared: int, dense: int, scale: float,
                 groups: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": shared * inter, "mlp_only_layers": tuple(range(dense)),
            "router": "sigmoid", "n_group": groups[0], "topk_group": groups[1], "routed_scaling_factor": scale}


def _next(nk: int, nv: int, d: int) -> dict[str, Any]:
    """Qwen3-Next-80B-A3B's linear attention and experts (512 of 512 rows, top-10, a 512-row gated shared one)."""
    return {"num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "full_attention_interval": 4, "linear_num_key_heads": nk,
            "linear_num_value_heads": nv, "linear_key_head_dim": d, "linear_value_head_dim": d,
            "linear_conv_kernel_dim": 4, "num_nextn_predict_layers": 1}  # one MTP layer (``mtp.*``)


# the tiny hybrids' linear attention and experts: 4 key heads (engine TP up to 4), 8 experts
_TINY_HYBRID: dict[str, Any] = {
    "partial_rotary_factor": 0.25, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128, "full_attention_interval": 4, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    "num_nextn_predict_layers": 1}


def _preset(name: str, family: str, H: int, L: int, h: int, ng: int, d: int, F: int, V: int,
            tied: bool, **extra: Any) -> ModelSpec:
    base: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, **FAMILIES[family].defaults, **extra}
    return ModelSpec.build(name=name, family=family, hidden_size=H, num_layers=L, num_heads=h,
                           num_kv_heads=ng, head_dim=d, intermediate_size=F, vocab_size=V,
                           tie_word_embeddings=tied, **base)


# Numbers from each model's published HuggingFace config.json (docs/models.md, "Presets").  Tiny presets: a few million
# parameters, GQA, vocab not a multiple of 64 (exercises engine vocab padding).
_PRESET_LIST = [
    _preset("Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-1.7B", "qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-4B", "qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-8B", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, max_position_embeddings=40960),
    _preset("Qwen3-14B", "qwen3", 5120, 40, 40, 8, 128, 17408, 151936, False, max_position_embeddings=40960),
    _preset("Qwen3-32B", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936, False, max_position_embeddings=40960),
    _preset("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 64, 4864, 151936, True),
    _preset("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True),
    _preset("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False),
    _preset("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True,
            rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072),
    _preset("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 128, 8192, 128256, True,
            rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072),
    _preset("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072),
    _preset("Llama-3.1-70B", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072),
    # tiny variants (CPU): head_dim != hidden/heads for Qwen3, as in the real family.
    _preset("tiny-qwen3", "qwen3", 256, 4, 8, 2, 64, 512, 1100, True,
            max_position_embeddings=2048, dtype="float32"),
    _preset("tiny-qwen2", "qwen2", 256, 4, 8, 2, 32, 640, 1000, True,
            max_position_embeddings=2048, dtype="float32"),
    _preset("tiny-llama", "llama", 256, 4, 8, 4, 32, 512, 1200, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=16384, dtype="float32"),
    # GLM4 dense (GLM-4-0414 architecture): post-attention and post-MLP norms, partial interleaved rotary
    _preset("GLM-4-9B-0414", "glm4", 4096, 40, 32, 2, 128, 13696, 151552, False, rms_norm_eps=1.5625e-07,
            rope_theta=10000.0, partial_rotary_factor=0.5),
    _preset("tiny-glm4", "glm4", 256, 4, 8, 2, 64, 512, 1100, False, max_position_embeddings=2048,
            rope_theta=10000.0, partial_rotary_factor=0.5, dtype="float32"),
    # GLM-4.5-Air (GLM4-MoE): 1 dense layer, 128 routed experts + 1 shared, sigmoid router, the checkpoint's MTP
    # layer (model.layers.46)
    _preset("GLM-4.5-Air", "glm4_moe", 4096, 46, 96, 8, 128, 10944, 151552, False, rms_norm_eps=1e-5,
            partial_rotary_factor=0.5, max_position_embeddings=131072, num_experts=128, num_experts_per_tok=8,
            moe_intermediate_size=1408, mlp_only_layers=(0,), router="sigmoid", shared_expert_intermediate_size=1408,
            attention_bias=True, qk_layernorm=False, num_nextn_predict_layers=1),
    # tiny: expert groups (2 of 4, top-1 group) and a routed scaling, q/k norms as GLM-4.5 (not Air)
    _preset("tiny-glm4-moe", "glm4_moe", 256, 4, 8, 2, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", partial_rotary_factor=0.5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            mlp_only_layers=(0,), router="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
            shared_expert_intermediate_size=128, attention_bias=True, qk_layernorm=True),
    # multi-head latent attention (DeepSeek-V3 architecture; docs/models.md names the sources).  d = nope + rope.
    _preset("DeepSeek-V3", "deepseek_v3", 7168, 61, 128, 128, 192, 18432, 129280, False, rope_theta=10000.0,
            rope_scaling=_yarn(40.0, 4096, beta_fast=32.0, beta_slow=1.0), max_position_embeddings=163840,
            **_mla(1536, 512, 128, 64, 128, nextn=1), **_sigmoid_moe(256, 8, 2048, shared=1, dense=3, groups=(8, 4),
                                                                  scale=2.5)),
    _preset("Kimi-K2", "deepseek_v3", 7168, 61, 64, 64, 192, 18432, 163840, False, rope_theta=50000.0,
            rope_scaling=_yarn(32.0, 4096, beta_fast=1.0, beta_slow=1.0), max_position_embeddings=131072,
            **_mla(1536, 512, 128, 64, 128), **_sigmoid_moe(384, 8, 2048, shared=1, dense=1, scale=2.827)),
    _preset("GLM-4.7-Flash", "glm4_moe_lite", 2048, 47, 20, 20, 256, 10240, 154880, False, rms_norm_eps=1e-5,
            max_position_embeddings=202752, **_mla(768, 512, 192, 64, 256, nextn=1),
            **_sigmoid_moe(64, 4, 1536, shared=1, dense=1, scale=1.8)),
    # tiny (CPU): yarn rope, expert groups, one dense layer, an MTP layer; a q_proj variant (no q_lora_rank);
    # GLM's wider nope and v heads than rope
    _preset("tiny-deepseek-v3", "deepseek_v3", 256, 4, 8, 8, 48, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(64, 32, 32, 16, 32, nextn=1),
            **_sigmoid_moe(8, 2, 128, shared=1, dense=1, groups=(2, 1), scale=2.5)),
    _preset("tiny-deepseek-v3-q-proj", "deepseek_v3", 256, 4, 8, 8, 48, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(None, 32, 32, 16, 32), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, groups=(2, 1), scale=2.5)),
    # FP8 engines: every MLA linear, expert and shared expert whole 128 x 128 blocks at engine TP 1/2 and EP 2
    # (q_lora = kv_lora = 128, 8 heads of 64 + 64, experts of 256 rows)
    _preset("tiny-deepseek-v3-fp8", "deepseek_v3", 256, 4, 8, 8, 128, 512, 1100, False, max_position_embeddings=2048,
            dtype="bfloat16", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(128, 128, 64, 64, 64, nextn=1),
            **_sigmoid_moe(8, 2, 256, shared=1, dense=1, groups=(2, 1), scale=2.5)),
    _preset("tiny-glm4-moe-lite", "glm4_moe_lite", 256, 4, 8, 8, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", **_mla(64, 32, 48, 16, 64), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, scale=1.8)),
    # DeepSeek sparse attention: MLA plus the lightning indexer.  GLM-5: zai-org/GLM-5's config (transformers'
    # GlmMoeDsaConfig defaults agree); GLM-5-4layer: the 4-layer GLM-5 the slime/miles examples run for small tests
    # (3 dense + 1 MoE layer, like their other 4-layer variants); DeepSeek-V3.2: DeepSeek-V3's numbers plus the indexer
    _preset("GLM-5", "glm_moe_dsa", 6144, 78, 64, 64, 256, 12288, 154880, False, rms_norm_eps=1e-5,
            max_position_embeddings=202752, **_mla(2048, 512, 192, 64, 256, nextn=1),
            **_sigmoid_moe(256, 8, 2048, shared=1, dense=3, scale=2.5), **_dsa(32, 128, 2048)),
    _preset("GLM-5-4layer", "glm_moe_dsa", 6144, 4, 64, 64, 256, 12288, 154880, False, rms_norm_eps=1e-5,
            max_position_embeddings=202752, **_mla(2048, 512, 192, 64, 256, nextn=1),
            **_sigmoid_moe(256, 8, 2048, shared=1, dense=3, scale=2.5), **_dsa(32, 128, 2048)),
    _preset("DeepSeek-V3.2", "deepseek_v32", 7168, 61, 128, 128, 192, 18432, 129280, False, rope_theta=10000.0,
            rope_scaling=_yarn(40.0, 4096, beta_fast=32.0, beta_slow=1.0), max_position_embeddings=163840,
            **_mla(1536, 512, 128, 64, 128, nextn=1), **_sigmoid_moe(256, 8, 2048, shared=1, dense=3, groups=(8, 4),
                                                                  scale=2.5), **_dsa(64, 128, 2048)),
    # tiny (CPU): a top-k smaller than the demo's sequences, so the indexer's choice matters; rms_norm_eps 1e-6:
    # transformers fixes the latent norms' eps at 1e-6, SGLang (and shardsync) use rms_norm_eps (docs/models.md)
    _preset("tiny-glm5", "glm_moe_dsa", 256, 4, 8, 8, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", **_mla(64, 32, 48, 16, 64, nextn=1),
            **_sigmoid_moe(8, 2, 128, shared=1, dense=1, scale=2.5), **_dsa(8, 32, 8)),
    _preset("tiny-deepseek-v32", "deepseek_v32", 256, 4, 8, 8, 48, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(64, 32, 32, 16, 32, nextn=1), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, groups=(2, 1), scale=2.5),
            **_dsa(8, 32, 8)),
    # FP8 engines: DeepSeek-V3-fp8's numbers (its YaRN rope too) plus the indexer (replicated: any size is whole
    # blocks)
    _preset("tiny-glm5-fp8", "glm_moe_dsa", 256, 4, 8, 8, 128, 512, 1100, False, max_position_embeddings=2048,
            dtype="bfloat16", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(128, 128, 64, 64, 64, nextn=1),
            **_sigmoid_moe(8, 2, 256, shared=1, dense=1, scale=2.5), **_dsa(8, 64, 8)),
    _preset("tiny-deepseek-v32-fp8", "deepseek_v32", 256, 4, 8, 8, 128, 512, 1100, False, max_position_embeddings=2048,
            dtype="bfloat16", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(128, 128, 64, 64, 64, nextn=1),
            **_sigmoid_moe(8, 2, 256, shared=1, dense=1, groups=(2, 1), scale=2.5), **_dsa(8, 64, 8)),
    # gated DeltaNet hybrids: Qwen3-Next-80B-A3B as slime's script and the published config give it (every layer
    # MoE; rope theta 1e7: slime's; some third-party copies say 5e6); tiny: 4 key heads (engine TP up to 4)
    _preset("Qwen3-Next-80B-A3B", "qwen3_next", 2048, 48, 16, 2, 256, 5120, 151936, False,
            max_position_embeddings=262144, rope_theta=10_000_000.0, partial_rotary_factor=0.25, **_next(16, 32, 128)),
    _preset("tiny-qwen3-next", "qwen3_next", 256, 4, 4, 2, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", **_TINY_HYBRID),
    # FP8 engines: whole 128 x 128 blocks at engine TP 1 and 2 (linear key and value heads of 64: SGLang wants each
    # of q, k, v, z of a rank's in_proj_qkvz whole blocks; KV heads of 128, experts of 256 rows)
    _preset("tiny-qwen3-next-fp8", "qwen3_next", 256, 4, 4, 2, 128, 512, 1100, False, max_position_embeddings=2048,
            dtype="bfloat16", **{**_TINY_HYBRID, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
                                 "linear_key_head_dim": 64, "linear_value_head_dim": 64}),
    # Qwen3.5-35B-A3B's text model (transformers' Qwen3_5MoeTextConfig defaults; slime's qwen3.5-35B-A3B.sh gives
    # rope theta 1e7; max positions 262144 from third-party copies of its config): separate linear projections
    _preset("Qwen3.5-35B-A3B", "qwen3_5_moe_text", 2048, 40, 16, 2, 256, 512, 248320, False,
            max_position_embeddings=262144, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
            **{**_next(16, 32, 128), "num_experts": 256, "num_experts_per_tok": 8}),
    _preset("tiny-qwen3.5-moe", "qwen3_5_moe_text", 256, 4, 4, 2, 64, 128, 1100, False, max_position_embeddings=2048,
            dtype="float32", **_TINY_HYBRID),
    _preset("tiny-qwen3.5-moe-fp8", "qwen3_5_moe_text", 256, 4, 4, 2, 128, 128, 1100, False,
            max_position_embeddings=2048, dtype="bfloat16",
            **{**_TINY_HYBRID, "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
               "linear_key_head_dim": 64, "linear_value_head_dim": 64}),
    # mixture of experts
    _preset("Qwen3-30B-A3B", "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, False,
            max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    _preset("Qwen3-235B-A22B", "qwen3_moe", 4096, 94, 64, 4, 128, 12288, 151936, False,
            max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    # tiny: a dense first layer (mlp_only_layers) and a sparse step of 1, vocab not a multiple of 64
    _preset("tiny-qwen3-moe", "qwen3_moe", 256, 4, 8, 2, 64, 512, 1100, True, max_position_embeddings=2048,
            dtype="float32", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=(0,)),
    # FP8 engines: every engine shard whole 128 x 128 blocks at engine TP 1/2/4 (8 kv heads, 512-wide MLPs)
    _preset("tiny-qwen3-fp8", "qwen3", 256, 4, 8, 8, 64, 512, 1100, True, max_position_embeddings=2048,
            dtype="bfloat16"),
    # (every layer sparse, the LM head untied: as released Qwen3-MoE checkpoints, and as SGLang builds them)
    _preset("tiny-qwen3-moe-fp8", "qwen3_moe", 256, 4, 8, 8, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="bfloat16", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512),
]
PRESETS: dict[str, ModelSpec] = {s.name: s for s in _PRESET_LIST}


def load_spec(model: str | Path, *, dtype: str | None = None) -> ModelSpec:
    """Resolve a preset name, a ``config.json`` path or a checkpoint directory to a spec."""
    key = str(model)
    if key in PRESETS:
        spec = PRESETS[key]
    else:
        path = Path(key)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {key!r} is neither a preset nor a config.json/checkpoint directory; "
                f"presets: {', '.join(PRESETS)}"
            )
        spec = spec_from_config(json.loads(path.read_text()), name=path.parent.name or key)
    return spec.replace(dtype=dtype) if dtype else spec
