"""Qwen2 (attention biases), Qwen3 (q/k norms) and Qwen3-MoE (softmax router, no shared
expert, ``mlp_only_layers`` and ``decoder_sparse_step`` choose the dense layers)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import GQA, MOE, gated_mlp
from shardsync.family.table import Family

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def _read_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    # transformers 5.19 writes Qwen3-MoE's expert count as num_local_experts (num_experts: null)
    return {"num_experts": cfg.get("num_experts") or cfg["num_local_experts"],
            "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "decoder_sparse_step": cfg.get("decoder_sparse_step", 1),
            "mlp_only_layers": tuple(cfg.get("mlp_only_layers") or ()),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True))}


def _write_moe(spec: ModelSpec) -> dict[str, Any]:
    return {"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size, "decoder_sparse_step": spec.decoder_sparse_step,
            "mlp_only_layers": list(spec.mlp_only_layers), "norm_topk_prob": spec.norm_topk_prob}


QWEN2 = Family("qwen2", "Qwen2ForCausalLM", GQA, gated_mlp(), qkv_bias=True)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", GQA, gated_mlp(), qk_norm=True)
QWEN3_MOE = Family("qwen3_moe", "Qwen3MoeForCausalLM", GQA, gated_mlp(), MOE, qk_norm=True, lm_head_every_stage=True,
                   read=_read_moe, write=_write_moe)
