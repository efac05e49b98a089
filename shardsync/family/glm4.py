"""GLM4 dense (GLM-4-0414: norms after attention and after the MLP, gate and up fused in the
checkpoint, partial rotary on neighbouring channel pairs) and GLM4-MoE (GLM-4.5: sigmoid
router with a score-correction bias, expert groups, shared experts, the first k layers
dense; attention bias and q/k norms are config keys; SGLang and vLLM hold its router in
float32; the checkpoint's MTP layer after the decoder)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import GQA, MTP, gated_mlp, moe
from shardsync.family.fields import first_k_dense, read_mtp, read_sigmoid_moe, write_mtp, write_sigmoid_moe
from shardsync.family.table import Family

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def _read_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    return {**read_sigmoid_moe(cfg), **read_mtp(cfg), "attention_bias": bool(cfg.get("attention_bias", False)),
            "qk_layernorm": bool(cfg.get("use_qk_norm", False))}


def _write_moe(spec: ModelSpec) -> dict[str, Any]:
    return {**write_sigmoid_moe(spec), **write_mtp(spec), "attention_bias": spec.qkv_bias,
            "use_qk_norm": spec.qk_norm}


GLM4 = Family("glm4", "Glm4ForCausalLM", GQA, gated_mlp(fused_checkpoint=True), qkv_bias=True, post_norms=True,
              fused_gate_up=True, rope_interleaved=True, write=lambda spec: {"attention_bias": spec.qkv_bias})
GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", GQA, gated_mlp(), moe(router_dtype="float32"), mtp=MTP,
                  qkv_bias=True, read=_read_moe, write=_write_moe, check=first_k_dense)
