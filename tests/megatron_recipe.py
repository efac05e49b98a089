"""The megatron-core TransformerConfig fields that make a GPTModel a Qwen2/Qwen3/Llama.

Shared by the CPU name/shape test and the GPU numerics check, so both build the same model.
"""

from __future__ import annotations

from typing import Any

import torch

from shardsync.spec import ModelSpec


def architecture(spec: ModelSpec) -> dict[str, Any]:
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
