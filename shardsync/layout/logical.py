"""Logical tensors: the HuggingFace names and full shapes every layout is expressed in."""

from __future__ import annotations

from shardsync.layout.piece import Segment
from shardsync.spec import ModelSpec


def gate_up_segments(spec: ModelSpec, prefix: str, start: int, length: int) -> list[Segment]:
    """Rows ``[start, start+length)`` of the gate, then of up, in the HF tensors of the dense MLP
    under ``prefix`` (``model.layers.L.mlp.``): two tensors, or GLM4's fused ``gate_up_proj``."""
    if spec.fused_gate_up:
        return [Segment(prefix + "gate_up_proj.weight", start, length),
                Segment(prefix + "gate_up_proj.weight", spec.intermediate_size + start, length)]
    return [Segment(prefix + "gate_proj.weight", start, length), Segment(prefix + "up_proj.weight", start, length)]


def is_expert(logical: str) -> bool:
    """Whether a logical tensor is one routed expert's (held by expert-parallel ranks)."""
    return ".mlp.experts." in logical


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensors of decoder layer ``layer`` (global index), in checkpoint order."""
    H, d, F = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    p = f"model.layers.{layer}."
    out: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (H,),
        p + "self_attn.q_proj.weight": (q, H),
        p + "self_attn.k_proj.weight": (kv, H),
        p + "self_attn.v_proj.weight": (kv, H),
    }
    if spec.qkv_bias:
        out[p + "self_attn.q_proj.bias"] = (q,)
        out[p + "self_attn.k_proj.bias"] = (kv,)
        out[p + "self_attn.v_proj.bias"] = (kv,)
    if spec.qk_norm:
        out[p + "self_attn.q_norm.weight"] = (d,)
        out[p + "self_attn.k_norm.weight"] = (d,)
    out[p + "self_attn.o_proj.weight"] = (H, q)
    if spec.post_norms:
        out[p + "post_self_attn_layernorm.weight"] = (H,)
    out[p + "post_attention_layernorm.weight"] = (H,)
    if spec.sparse_layer(layer):  # the router, every expert's gate, up and down, the shared experts
        E, Fe, Fs = spec.num_experts, spec.moe_intermediate_size, spec.shared_expert_intermediate_size
        out[p + "mlp.gate.weight"] = (E, H)
        if spec.router == "sigmoid":
            out[p + "mlp.gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            out[p + f"mlp.experts.{e}.gate_proj.weight"] = (Fe, H)
            out[p + f"mlp.experts.{e}.up_proj.weight"] = (Fe, H)
            out[p + f"mlp.experts.{e}.down_proj.weight"] = (H, Fe)
        if Fs:
            out[p + "mlp.shared_experts.gate_proj.weight"] = (Fs, H)
            out[p + "mlp.shared_experts.up_proj.weight"] = (Fs, H)
            out[p + "mlp.shared_experts.down_proj.weight"] = (H, Fs)
        return out
    if spec.fused_gate_up:
        out[p + "mlp.gate_up_proj.weight"] = (2 * F, H)
    else:
        out[p + "mlp.gate_proj.weight"] = (F, H)
        out[p + "mlp.up_proj.weight"] = (F, H)
    out[p + "mlp.down_proj.weight"] = (H, F)
    if spec.post_norms:
        out[p + "post_mlp_layernorm.weight"] = (H,)
    return out


def logical_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the model; a tied ``lm_head`` is not a tensor of its own."""
    V, H = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(spec.num_layers):
        out.update(layer_tensors(spec, layer))
    out["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out
