"""The megatron-core TransformerConfig fields that make a GPTModel a Qwen2/Qwen3/Llama/Qwen3-MoE,
a GLM4-MoE, or (MLATransformerConfig) a DeepSeek-V3 / GLM-4.7-Flash.

Shared by the CPU name/shape test and the GPU numerics check, so both build the same model.
"""

from __future__ import annotations

from typing import Any

import torch

from shardsync.family.section import Indexer, Latent
from shardsync.spec import ModelSpec


def architecture(spec: ModelSpec) -> dict[str, Any]:
    return {**_common(spec), **(mla_architecture(spec) if spec.find(Latent) is not None else {})}


def mla_architecture(spec: ModelSpec) -> dict[str, Any]:
    """MLATransformerConfig's latent attention fields (megatron-core's ``qk_head_dim`` is the
    nope part).  Rotary: plain ``rope`` (yarn's numerics are the GPU check's business)."""
    lat, ix = spec.section(Latent), spec.find(Indexer)
    dsa = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=ix.index_n_heads,
               dsa_indexer_head_dim=ix.index_head_dim, dsa_indexer_topk=ix.index_topk,
               dsa_indexer_loss_coeff=0.0) if ix is not None else {}
    return dict(multi_latent_attention=True, q_lora_rank=lat.q_lora_rank, kv_lora_rank=lat.kv_lora_rank,
                qk_head_dim=lat.qk_nope_head_dim, qk_pos_emb_head_dim=lat.qk_rope_head_dim,
                v_head_dim=lat.v_head_dim, rope_type="rope", qk_layernorm=True, **dsa)


def _common(spec: ModelSpec) -> dict[str, Any]:
    return dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        ffn_hidden_size=spec.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
    )


def moe_architecture(spec: ModelSpec) -> dict[str, Any]:
    """The router and experts of a Qwen3-MoE (empty for a dense spec).  Softmax over the top-k
    logits is HF's renormalized top-k of the full softmax (``norm_topk_prob``)."""
    if not spec.is_moe:
        return {}
    return dict(
        num_moe_experts=spec.num_experts,
        moe_router_topk=spec.num_experts_per_tok,
        moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_router_pre_softmax=not spec.norm_topk_prob,
        # per-layer pattern, 1 = MoE, 0 = dense (read by get_gpt_decoder_block_spec)
        moe_layer_freq=[int(spec.sparse_layer(n)) for n in range(spec.num_layers)],
        moe_router_load_balancing_type="none",
        moe_grouped_gemm=False,  # SequentialMLP; TEGroupedMLP needs transformer_engine
        moe_token_dispatcher_type="allgather",
        **(GLM4_MOE_ROUTER(spec) if spec.router == "sigmoid" else {}),
    )


def GLM4_MOE_ROUTER(spec: ModelSpec) -> dict[str, Any]:  # noqa: N802 (a table entry)
    """GLM4-MoE: sigmoid scores, expert bias (a buffer), group-limited top-k, scaling, shared experts."""
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=spec.n_group if spec.n_group > 1 else None,
        moe_router_group_topk=spec.topk_group if spec.n_group > 1 else None,
        moe_router_topk_scaling_factor=spec.routed_scaling_factor,
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=spec.shared_expert_intermediate_size or None,
    )
