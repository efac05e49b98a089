"""Multi-head latent attention (DeepSeek-V3, Kimi-K2, GLM-4.7-Flash) for both reference models,
in the plain form: queries through the low-rank ``q_a``/``q_b`` pair (or ``q_proj``), keys and
values expanded from the shared latent by ``kv_b_proj``, the rope part of every key shared by
the heads.  Heads split over TP on both sides; the output projection is row-parallel.  The
engine holds SGLang's parameters (``fused_qkv_a_proj_with_mqa`` = [q_a; kv_a]); the trainer
Megatron's (TE spec: down projections whole, norms fused into the up projections; local spec:
down projections column-parallel with gathered output, separate norms)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardsync.family.section import Latent
from shardsync.family.table import Attention
from shardsync.models.ops import apply_rope, attention, rms_norm
from shardsync.models.parallel import Comm
from shardsync.models.sparse import index_keys, select
from shardsync.spec import ModelSpec

if TYPE_CHECKING:
    from shardsync.models.decoding import KVCache
    from shardsync.models.engine_layers import Leaf
    from shardsync.models.trainer_layers import Weights


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(spec: ModelSpec) -> float:
    """1/sqrt(nope + rope), times mscale(factor, mscale_all_dim)^2 under yarn (DeepSeek's rule)."""
    scale = 1.0 / math.sqrt(spec.head_dim)
    rs = spec.rope_scaling or {}
    if rs.get("rope_type") == "yarn" and rs.get("mscale_all_dim"):
        m = yarn_mscale(rs["factor"], rs["mscale_all_dim"])
        scale *= m * m
    return scale


def latent_heads(spec: ModelSpec, q: torch.Tensor, kv: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, cache: KVCache | None = None, layer: int = 0,
                 chosen: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a rank's heads: ``q`` [b, s, h(nope + rope)], ``kv`` [b, s, h(nope + v)]
    (``kv_b_proj`` of the latent), ``k_rope`` [b, s, rope] shared by the heads -> [b, s, h v].
    Rotary on the rope channels, neighbouring pairs; keys and values cached as ``cache`` holds.
    ``chosen`` [b, s, t]: the keys each query may see (sparse attention), besides the causal mask."""
    lat = spec.section(Latent)
    nope, rope, vd = lat.qk_nope_head_dim, lat.qk_rope_head_dim, lat.v_head_dim
    b, s = q.shape[0], q.shape[1]
    h = q.shape[-1] // (nope + rope)
    q = q.view(b, s, h, nope + rope).transpose(1, 2)
    k_nope, v = kv.view(b, s, h, nope + vd).transpose(1, 2).split([nope, vd], dim=-1)
    q = torch.cat((q[..., :nope], apply_rope(q[..., nope:], cos, sin, interleaved=True)), dim=-1)
    shared = apply_rope(k_rope.reshape(b, 1, s, rope), cos, sin, interleaved=True).expand(b, h, s, rope)
    k = torch.cat((k_nope, shared), dim=-1)
    start = 0
    if cache is not None:
        start = cache.length
        cache.keys[layer][:, :, start:start + s] = k
        cache.values[layer][:, :, start:start + s] = v
        k, v = cache.keys[layer][:, :, :start + s], cache.values[layer][:, :, :start + s]
    mask = None if chosen is None else chosen[:, None]
    out = attention(q, k, v, causal_offset=start, mask=mask, scale=softmax_scale(spec))
    return out.transpose(1, 2).reshape(b, s, h * vd)


class Baton:
    """The last indexer's choice within one forward, for the layers that reuse it (GLM-5's
    shared layers): every layer of a model holds the same baton."""

    def __init__(self) -> None:
        self.chosen: torch.Tensor | None = None

    def take(self, layer: int) -> torch.Tensor:
        if self.chosen is None:
            raise RuntimeError(f"layer {layer} reuses the indexer choice of a layer before it, and none ran "
                               "(a pipeline stage cannot start on a shared sparse-attention layer)")
        return self.chosen


class _EngineIndexer(Protocol):
    """``LatentAttention.indexer``: a plain module holding the indexer's leaves (SGLang's names)."""

    wq_b: Leaf
    wk: Leaf
    weights_proj: Leaf
    k_norm: Leaf


class _TrainerIndexer(Protocol):
    """``TrainerLatentAttention.core_attention.indexer``: a plain module holding megatron-core's."""

    linear_wq_b: Weights
    linear_wk: Weights
    k_norm: Weights
    linear_weights_proj: Weights


class LatentAttention(nn.Module):
    """One engine rank's MLA heads.  ``leaf(name, attrs)`` makes the parameter holders (the
    engine's: ``dense()`` is a weight as the math reads it, dequantized when held in FP8, and
    ``linear(x)`` multiplies by it, in FP8 where the GPU can).
    Sparse attention: ``kind`` "dsa" runs this layer's indexer (SGLang's names, replicated) and
    passes its choice on through ``baton``; "dsa_shared" reuses the choice of the layer before."""

    def __init__(self, spec: ModelSpec, prefix: str, tp_size: int, leaf: Callable[[str, tuple[str, ...]], Leaf],
                 all_reduce: Callable[[torch.Tensor], torch.Tensor], *, kind: Attention = Attention.MLA,
                 baton: Baton | None = None) -> None:
        super().__init__()
        self.spec, self.all_reduce, self.kind, self.baton = spec, all_reduce, kind, baton or Baton()
        if spec.section(Latent).q_lora_rank is not None:
            self.fused_qkv_a_proj_with_mqa = leaf(prefix + "fused_qkv_a_proj_with_mqa", ("weight",))
            self.q_a_layernorm = leaf(prefix + "q_a_layernorm", ("weight",))
            self.q_b_proj = leaf(prefix + "q_b_proj", ("weight",))
        else:
            self.q_proj = leaf(prefix + "q_proj", ("weight",))
            self.kv_a_proj_with_mqa = leaf(prefix + "kv_a_proj_with_mqa", ("weight",))
        self.kv_a_layernorm = leaf(prefix + "kv_a_layernorm", ("weight",))
        self.kv_b_proj = leaf(prefix + "kv_b_proj", ("weight",))
        self.o_proj = leaf(prefix + "o_proj", ("weight",))
        if kind is Attention.DSA:
            self.indexer = nn.Module()
            for name in ("wq_b", "wk", "weights_proj"):
                self.indexer.add_module(name, leaf(f"{prefix}indexer.{name}", ("weight",)))
            self.indexer.k_norm = leaf(prefix + "indexer.k_norm", ("weight", "bias"))
        # what a KV cache holds per layer: every local head's key (nope + rope) and value
        self.nkv, self.k_dim, self.v_dim = spec.num_heads // tp_size, spec.head_dim, spec.section(Latent).v_head_dim

    def _choose(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, layer: int) -> torch.Tensor | None:
        """Sparse attention: which keys each query sees (this layer's indexer, or the layer before's)."""
        if self.kind is Attention.MLA:
            return None
        if self.kind is Attention.DSA_SHARED:
            return self.baton.take(layer)
        ix = cast(_EngineIndexer, self.indexer)
        keys = index_keys(self.spec, x, ix.wk.dense(), ix.k_norm.weight, ix.k_norm.bias, cos, sin)
        start = 0
        if cache is not None:
            start, s = cache.length, x.shape[1]
            cache.index_keys[layer][:, start:start + s] = keys
            keys = cache.index_keys[layer][:, :start + s]
        self.baton.chosen = select(self.spec, x, q_latent, keys, ix.wq_b.dense(), ix.weights_proj.weight, cos, sin,
                                   start)
        return self.baton.chosen

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer: int) -> torch.Tensor:
        spec, eps = self.spec, self.spec.rms_norm_eps
        lat = spec.section(Latent)
        q_latent = x
        if lat.q_lora_rank is None:
            q, kva = self.q_proj.linear(x), self.kv_a_proj_with_mqa.linear(x)
        else:
            qa, kva = self.fused_qkv_a_proj_with_mqa.linear(x).split(
                [lat.q_lora_rank, lat.kv_lora_rank + lat.qk_rope_head_dim], dim=-1)
            q_latent = rms_norm(qa, self.q_a_layernorm.weight, eps)
            q = self.q_b_proj.linear(q_latent)
        latent, k_rope = kva.split([lat.kv_lora_rank, lat.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj.linear(rms_norm(latent, self.kv_a_layernorm.weight, eps))
        chosen = self._choose(x, q_latent, cos, sin, cache, layer)
        out = latent_heads(spec, q, kv, k_rope, cos, sin, cache, layer, chosen)
        return self.all_reduce(self.o_proj.linear(out))


class TrainerLatentAttention(nn.Module):
    """One trainer rank's ``self_attention`` under Megatron's MLA names.  ``weights(name, attrs,
    tp_sharded)`` takes the parameters; ``fused``: the TE spec's layout, else the local spec's.

    TP: whatever the rank's heads read from replicated activations passes ``copy_to`` (its
    gradient sums over TP); the local spec's down projections see ``copy_to`` input and gather
    their output."""

    def __init__(self, spec: ModelSpec, prefix: str, tp: Comm, fused: bool,
                 weights: Callable[[str, tuple[str, ...], bool], Weights], *, kind: Attention = Attention.MLA,
                 baton: Baton | None = None, layer: int = 0) -> None:
        super().__init__()
        self.spec, self.tp, self.fused, self.kind, self.baton = spec, tp, fused, kind, baton or Baton()
        self.layer = layer
        p = prefix + "self_attention."
        if kind is Attention.DSA:  # megatron-core's DSA: the indexer lives in core_attention (built first), replicated
            self.core_attention = nn.Module()
            ix = self.core_attention.indexer = nn.Module()
            for name in ("linear_wq_b", "linear_wk", "k_norm", "linear_weights_proj"):  # megatron-core's order
                attrs = ("weight", "bias") if name == "k_norm" else ("weight",)
                ix.add_module(name, weights(f"{p}core_attention.indexer.{name}", attrs, False))
            ix.requires_grad_(False)  # no gradient reaches it (top-k); its own training loss is not run here
        ln = ("layer_norm_weight",) if fused else ()
        if spec.section(Latent).q_lora_rank is not None:
            self.linear_q_down_proj = weights(p + "linear_q_down_proj", ("weight",), not fused)
            self.linear_q_up_proj = weights(p + "linear_q_up_proj", (*ln, "weight"), True)
        else:
            self.linear_q_proj = weights(p + "linear_q_proj", ("weight",), True)
        self.linear_kv_down_proj = weights(p + "linear_kv_down_proj", ("weight",), not fused)
        self.linear_kv_up_proj = weights(p + "linear_kv_up_proj", (*ln, "weight"), True)
        self.linear_proj = weights(p + "linear_proj", ("weight",), True)
        if not fused:
            if spec.section(Latent).q_lora_rank is not None:
                self.q_layernorm = weights(p + "q_layernorm", ("weight",), False)
            self.kv_layernorm = weights(p + "kv_layernorm", ("weight",), False)

    def _choose(self, h: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor | None:
        if self.kind is Attention.MLA:
            return None
        if self.kind is Attention.DSA_SHARED:
            return self.baton.take(self.layer)
        ix = cast(_TrainerIndexer, self.core_attention.indexer)
        keys = index_keys(self.spec, h, ix.linear_wk.weight.to(dtype), ix.k_norm.weight, ix.k_norm.bias, cos, sin)
        self.baton.chosen = select(self.spec, h, q_latent, keys, ix.linear_wq_b.weight.to(dtype),
                                   ix.linear_weights_proj.weight, cos, sin)
        return self.baton.chosen

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``h``: the normed input (replicated over TP) -> the attention output, reduced."""
        spec, tp, eps = self.spec, self.tp, self.spec.rms_norm_eps
        lat = spec.section(Latent)

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype)

        def down(mod: Weights, x: torch.Tensor) -> torch.Tensor:
            out = F.linear(x, w(mod.weight))
            return out if self.fused else tp.gather_last(out)

        x = h if self.fused else tp.copy_to(h)
        qa = h
        if lat.q_lora_rank is None:
            q = F.linear(x if not self.fused else tp.copy_to(h), w(self.linear_q_proj.weight))
        else:
            gain = self.linear_q_up_proj.layer_norm_weight if self.fused else self.q_layernorm.weight
            qa = rms_norm(down(self.linear_q_down_proj, x), w(gain), eps)
            q = F.linear(tp.copy_to(qa), w(self.linear_q_up_proj.weight))
        chosen = self._choose(h, qa, cos, sin, dtype)
        latent, k_rope = down(self.linear_kv_down_proj, x).split([lat.kv_lora_rank, lat.qk_rope_head_dim], dim=-1)
        gain = self.linear_kv_up_proj.layer_norm_weight if self.fused else self.kv_layernorm.weight
        kv = F.linear(tp.copy_to(rms_norm(latent, w(gain), eps)), w(self.linear_kv_up_proj.weight))
        out = latent_heads(spec, q, kv, tp.copy_to(k_rope), cos, sin, chosen=chosen)
        return tp.reduce_from(F.linear(out, w(self.linear_proj.weight)))
