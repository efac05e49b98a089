"""HF config fields several families share: the sigmoid-routed mixture of experts of
GLM4-MoE and DeepSeek-V3 (``n_routed_experts``, expert groups, shared experts, the first k
layers dense) and DeepSeek's latent attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.section import Latent

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def read_sigmoid_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    k, inter = cfg.get("first_k_dense_replace", 0), cfg["moe_intermediate_size"]
    if cfg.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={cfg['moe_layer_freq']} is not supported (every layer after the "
                         "first k dense ones is sparse)")
    return {"num_experts": cfg["n_routed_experts"], "num_experts_per_tok": cfg["num_experts_per_tok"],
            "moe_intermediate_size": inter, "mlp_only_layers": tuple(range(k)),
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", True)), "router": "sigmoid",
            "n_group": cfg.get("n_group") or 1, "topk_group": cfg.get("topk_group") or 1,
            "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
            "shared_expert_intermediate_size": inter * (cfg.get("n_shared_experts") or 0)}


def write_sigmoid_moe(spec: ModelSpec) -> dict[str, Any]:
    return {"n_routed_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "n_shared_experts": spec.shared_expert_intermediate_size // spec.moe_intermediate_size,
            "first_k_dense_replace": len(spec.mlp_only_layers), "norm_topk_prob": spec.norm_topk_prob,
            "n_group": spec.n_group, "topk_group": spec.topk_group,
            "routed_scaling_factor": spec.routed_scaling_factor}


def first_k_dense(spec: ModelSpec) -> str | None:
    if spec.decoder_sparse_step != 1 or spec.mlp_only_layers != tuple(range(len(spec.mlp_only_layers))):
        return "the dense layers are the first k (first_k_dense_replace)"
    return None


def read_mtp(cfg: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's MTP layers after the decoder (GLM4-MoE, DeepSeek-V3)."""
    return {"num_nextn_predict_layers": cfg.get("num_nextn_predict_layers") or 0}


def write_mtp(spec: ModelSpec) -> dict[str, Any]:
    return {"num_nextn_predict_layers": spec.num_nextn_predict_layers}


def read_mla(cfg: dict[str, Any]) -> dict[str, Any]:
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    return {"head_dim": nope + rope, "num_kv_heads": cfg["num_attention_heads"], **read_mtp(cfg)}


def write_mla(spec: ModelSpec) -> dict[str, Any]:
    return {**write_mtp(spec),
            "head_dim": spec.section(Latent).qk_rope_head_dim,  # transformers' rotary reads head_dim as the rope part
            # what SGLang's DeepSeek classes read and transformers' config classes lack
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "rope_interleave": True}
