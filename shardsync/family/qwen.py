"""Qwen2 (attention biases), Qwen3 (q/k norms), Qwen3-MoE (softmax router, no shared
expert, ``mlp_only_layers`` and ``decoder_sparse_step`` choose the dense layers) and Qwen3-Next
and Qwen3.5-MoE (the gated DeltaNet hybrids: three linear-attention layers to one gated
full-attention layer, zero-centred norms, a gated shared expert; ``family/linear.py``; Qwen3.5's
checkpoint keeps the linear projections apart, and every layer is MoE)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import GQA, MOE, gated_mlp, moe
from shardsync.family.linear import GATED_DELTANET, GATED_DELTANET_SEPARATE, GATED_GQA, QWEN_MTP
from shardsync.family.section import Linear
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


def _read_next(cfg: dict[str, Any]) -> dict[str, Any]:
    mtp = cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0  # Qwen3-Next's / Qwen3.5's
    return {**_read_moe(cfg), "num_nextn_predict_layers": mtp,
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0}


def _write_next(spec: ModelSpec) -> dict[str, Any]:
    return {**_write_moe(spec), "num_nextn_predict_layers": spec.num_nextn_predict_layers,
            "mtp_num_hidden_layers": spec.num_nextn_predict_layers,
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size}


QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", GATED_GQA, gated_mlp(),
                    moe(shared="mlp.shared_expert.", shared_gate=True), linear_attention=GATED_DELTANET, mtp=QWEN_MTP,
                    qk_norm=True, norm_offset=1.0, sections=(Linear,), read=_read_next, write=_write_next)


def _read_next_35(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5-MoE's text config: no dense layers (no ``intermediate_size``), the top-k always
    renormalized (no ``norm_topk_prob``)."""
    own = _read_next({**cfg, "norm_topk_prob": True})
    return {**own, "intermediate_size": cfg.get("intermediate_size") or cfg["moe_intermediate_size"]}


def _write_next_35(spec: ModelSpec) -> dict[str, Any]:
    """Qwen3.5's rotary is multimodal (sections of the rotary half for time, height and width,
    interleaved); on text every section sees the same position, so it is the 1-D partial rotary.
    The config carries the sections as the released ones do (SGLang's rotary requires them)."""
    half = round(spec.head_dim * spec.partial_rotary_factor) // 2
    first = -(-half // 3)
    return {**_write_next(spec), "rope_parameters": {
        "rope_type": "default", "rope_theta": spec.rope_theta, "partial_rotary_factor": spec.partial_rotary_factor,
        "mrope_section": [first, first, half - 2 * first], "mrope_interleaved": True}}


QWEN3_5_MOE = Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", GATED_GQA, gated_mlp(),
                     moe(shared="mlp.shared_expert.", shared_gate=True), linear_attention=GATED_DELTANET_SEPARATE,
                     mtp=QWEN_MTP,
                     qk_norm=True, norm_offset=1.0, sections=(Linear,), read=_read_next_35,
                     write=_write_next_35)
