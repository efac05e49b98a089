"""Qwen2 (attention biases), Qwen3 (q/k norms), Qwen3-MoE (softmax router, no shared
expert, ``mlp_only_layers`` and ``decoder_sparse_step`` choose the dense layers) and Qwen3-Next
and Qwen3.5-MoE (the gated DeltaNet hybrids: three linear-attention layers to one gated
full-attention layer, zero-centred norms, a gated shared expert; ``family/linear.py``; Qwen3.5's
checkpoint keeps the linear projections apart, and every layer is MoE)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import GQA, MOE, gated_mlp, moe
from shardsync.family.linear import GATED_DELTANET, GATED_DELTANET_SEPARATE, GATED_GQA, QWEN_MTP
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


_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


def _linear_fields(spec: ModelSpec) -> dict[str, int]:
    return {"linear_num_key_heads": spec.linear_num_key_heads, "linear_num_value_heads": spec.linear_num_value_heads,
            "linear_key_head_dim": spec.linear_key_head_dim, "linear_value_head_dim": spec.linear_value_head_dim,
            "linear_conv_kernel_dim": spec.linear_conv_kernel_dim}


def _read_next(cfg: dict[str, Any]) -> dict[str, Any]:
    """SGLang reads only ``full_attention_interval`` (its ``layers_block_type``); a ``layer_types``
    that no interval gives is refused rather than served differently."""
    layers = cfg["num_hidden_layers"]
    interval = cfg.get("full_attention_interval") or 4
    kinds = cfg.get("layer_types")
    if kinds is not None:
        full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
        interval = full[0] + 1 if full else 0
        want = ["full_attention" if interval and (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        if list(kinds) != want:
            raise ValueError("layer_types must be full attention on every n-th layer and linear attention elsewhere "
                             f"(SGLang reads full_attention_interval only); got {kinds}")
    mtp = cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers") or 0  # Qwen3-Next's / Qwen3.5's
    return {**_read_moe(cfg), **{k: cfg[k] for k in _LINEAR}, "full_attention_interval": interval,
            "num_nextn_predict_layers": mtp,
            "shared_expert_intermediate_size": cfg.get("shared_expert_intermediate_size") or 0}


def _write_next(spec: ModelSpec) -> dict[str, Any]:
    kinds = ["linear_attention" if spec.linear_layer(i) else "full_attention" for i in range(spec.num_layers)]
    return {**_write_moe(spec), **_linear_fields(spec),
            "full_attention_interval": spec.full_attention_interval, "layer_types": kinds,
            "num_nextn_predict_layers": spec.num_nextn_predict_layers,
            "mtp_num_hidden_layers": spec.num_nextn_predict_layers,
            "shared_expert_intermediate_size": spec.shared_expert_intermediate_size}


def _check_next(spec: ModelSpec) -> str | None:
    nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
    if not (spec.full_attention_interval > 0 and nk > 0 and nv % nk == 0 and spec.linear_key_head_dim > 0
            and spec.linear_value_head_dim > 0 and spec.linear_conv_kernel_dim > 0):
        return ("a gated DeltaNet hybrid needs full_attention_interval > 0, positive linear head counts and dims "
                "(value heads a multiple of key heads) and a conv kernel")
    return None


QWEN3_NEXT = Family("qwen3_next", "Qwen3NextForCausalLM", GATED_GQA, gated_mlp(),
                    moe(shared="mlp.shared_expert.", shared_gate=True), linear_attention=GATED_DELTANET, mtp=QWEN_MTP,
                    qk_norm=True, norm_offset=1.0, read=_read_next, write=_write_next, check=_check_next)


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
                     qk_norm=True, norm_offset=1.0, read=_read_next_35, write=_write_next_35, check=_check_next)
