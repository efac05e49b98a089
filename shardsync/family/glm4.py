"""GLM4 dense (GLM-4-0414: norms after attention and after the MLP, gate and up fused in the
checkpoint, partial rotary on neighbouring channel pairs) and GLM4-MoE (GLM-4.5: sigmoid
router with a score-correction bias, expert groups, shared experts, the first k layers
dense; attention bias and q/k norms are config keys)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import GQA, MOE, gated_mlp
from shardsync.family.table import Family

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def _read_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    k, inter = cfg.get("first_k_dense_replace", 0), cfg["moe_intermediate_size"]
    return {"num_experts": cfg["n_routed_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": inter, "mlp_only_layers": tuple(range(k)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "router": "sigmoid",
            "n_group": cfg.get("n_group", 1), "topk_group": cfg.get("topk_group", 1),
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_intermediate_size": inter * cfg.get("n_shared_experts", 0),
            "attention_bias": bool(cfg.get("attention_bias", False)),
            "qk_layernorm": bool(cfg.get("use_qk_norm", False))}


def _write_moe(spec: ModelSpec) -> dict[str, Any]:
    return {"attention_bias": spec.qkv_bias, "n_routed_experts": spec.num_experts,
            "num_experts_per_tok": spec.num_experts_per_tok, "moe_intermediate_size": spec.moe_intermediate_size,
            "n_shared_experts": spec.shared_expert_intermediate_size // spec.moe_intermediate_size,
            "first_k_dense_replace": len(spec.mlp_only_layers), "norm_topk_prob": spec.norm_topk_prob,
            "n_group": spec.n_group, "topk_group": spec.topk_group,
            "routed_scaling_factor": spec.routed_scaling_factor, "use_qk_norm": spec.qk_norm}


def _check_moe(spec: ModelSpec) -> str | None:
    if spec.decoder_sparse_step != 1 or spec.mlp_only_layers != tuple(range(len(spec.mlp_only_layers))):
        return "GLM4-MoE's dense layers are the first k (first_k_dense_replace)"
    return None


GLM4 = Family("glm4", "Glm4ForCausalLM", GQA, gated_mlp(fused_checkpoint=True), qkv_bias=True, post_norms=True,
              fused_gate_up=True, rope_interleaved=True, write=lambda spec: {"attention_bias": spec.qkv_bias})
GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", GQA, gated_mlp(), MOE, qkv_bias=True,
                  read=_read_moe, write=_write_moe, check=_check_moe)
