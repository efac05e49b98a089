"""HF config fields several families share: the sigmoid-routed mixture of experts of
GLM4-MoE and DeepSeek-V3 (``n_routed_experts``, expert groups, shared experts, the first k
layers dense) and DeepSeek's latent attention."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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


def latent_dims(spec: ModelSpec) -> str | None:
    if not (spec.kv_lora_rank > 0 and min(spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim) > 0
            and spec.head_dim == spec.qk_nope_head_dim + spec.qk_rope_head_dim
            and (spec.q_lora_rank is None or spec.q_lora_rank > 0)):
        return ("latent attention needs positive kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                "v_head_dim, head_dim = nope + rope, and q_lora_rank None or > 0")
    return None


def read_mtp(cfg: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's MTP layers after the decoder (GLM4-MoE, DeepSeek-V3)."""
    return {"num_nextn_predict_layers": cfg.get("num_nextn_predict_layers") or 0}


def write_mtp(spec: ModelSpec) -> dict[str, Any]:
    return {"num_nextn_predict_layers": spec.num_nextn_predict_layers}


def read_mla(cfg: dict[str, Any]) -> dict[str, Any]:
    nope, rope = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
    return {"q_lora_rank": cfg.get("q_lora_rank"), "kv_lora_rank": cfg["kv_lora_rank"], "qk_nope_head_dim": nope,
            "qk_rope_head_dim": rope, "v_head_dim": cfg["v_head_dim"], "head_dim": nope + rope,
            "num_kv_heads": cfg["num_attention_heads"], **read_mtp(cfg)}


def write_mla(spec: ModelSpec) -> dict[str, Any]:
    return {"q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
            "qk_nope_head_dim": spec.qk_nope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
            "v_head_dim": spec.v_head_dim, **write_mtp(spec),
            "head_dim": spec.qk_rope_head_dim,  # transformers' rotary reads head_dim as the rope part
            # what SGLang's DeepSeek classes read and transformers' config classes lack
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "rope_interleave": True}


def read_dsa(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek sparse attention's indexer.  GLM-5 may mark layers ``shared`` (they reuse the
    layer before's choice and hold no indexer): ``indexer_types``, or transformers' schedule
    from ``index_topk_freq`` / ``index_skip_topk_offset`` (every layer full by default)."""
    layers = cfg["num_hidden_layers"]
    kinds = cfg.get("indexer_types")
    if kinds is None:
        freq, offset = max(cfg.get("index_topk_freq") or 1, 1), cfg.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
    unknown = sorted(set(kinds) - {"full", "shared"})
    if unknown or len(kinds) != layers:
        raise ValueError(f"indexer_types must name each of the {layers} layers 'full' or 'shared' (got {kinds})")
    if kinds and kinds[0] == "shared":
        raise ValueError("indexer_types: the first layer must be 'full' (a shared layer reuses the one before)")
    return {"index_n_heads": cfg["index_n_heads"], "index_head_dim": cfg["index_head_dim"],
            "index_topk": cfg["index_topk"],
            "index_shared_layers": tuple(i for i, kind in enumerate(kinds) if kind == "shared")}


def write_dsa(spec: ModelSpec) -> dict[str, Any]:
    shared = set(spec.index_shared_layers)
    return {"index_n_heads": spec.index_n_heads, "index_head_dim": spec.index_head_dim,
            "index_topk": spec.index_topk,
            "indexer_types": ["shared" if i in shared else "full" for i in range(spec.num_layers)]}


def indexer_dims(spec: ModelSpec) -> str | None:
    if not (spec.index_n_heads > 0 and spec.index_topk > 0 and spec.q_lora_rank
            and spec.qk_rope_head_dim <= spec.index_head_dim):
        return ("sparse attention needs positive index_n_heads and index_topk, a q_lora_rank (the indexer reads "
                "the query's latent) and index_head_dim >= qk_rope_head_dim")
    if 0 in spec.index_shared_layers or any(not 0 <= i < spec.num_layers for i in spec.index_shared_layers):
        return "index_shared_layers must be layers after the first"
    return None
