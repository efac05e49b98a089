"""The reference engine's building blocks on one TP rank under SGLang's names: the TP group's
collectives (``TP``), parameter leaves (``Leaf``: the layout's shapes and dtypes, some held in FP8),
grouped-query and linear attention, the gated MLP, a sparse layer's router and experts, the table from
a family's attention kind to its module (``ATTENTION``), the decoder layer and the ``model.`` decoder.
``EngineModel`` (``models.engine``) assembles them; its docstring describes the TP scheme."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsync.dtypes import torch_dtype
from shardsync.family.table import Attention
from shardsync.layout import RankLayout
from shardsync.models.decoding import KVCache
from shardsync.models.deltanet import DeltaWeights, deltanet
from shardsync.models.fp8_gemm import scaled, scaled_linear
from shardsync.models.latent import Baton, LatentAttention
from shardsync.models.lora import LoraTerm
from shardsync.models.ops import apply_rope, attention, rms_norm, route, router_logits
from shardsync.quant import Fp8Format, dequantize
from shardsync.spec import ModelSpec


class TP:
    """The TP group's collectives; no-ops when the group has one rank."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x


def _hold(module: nn.Module, rl: RankLayout, prefix: str, attrs: Sequence[str], device: torch.device) -> None:
    """Register the parameters ``<prefix>.<attr>`` on ``module`` with the layout's shape and dtype (zeroed)."""
    for attr in attrs:
        meta = rl.tensor(f"{prefix}.{attr}")
        data = torch.zeros(meta.stored, dtype=torch_dtype(meta.dtype), device=device)
        module.register_parameter(attr, nn.Parameter(data, requires_grad=False))


class Leaf(nn.Module):
    """Holds the parameters ``<prefix>.<attr>`` with the layout's shape and dtype (zeroed).
    An FP8 engine holds some of them quantized (``fp8``: attr -> format and compute dtype),
    each with its scale beside it; ``dense`` gives the math its weights either way, ``linear``
    multiplies by one, in FP8 where the GPU has the kernel (``gemm``: those attrs)."""

    # read as attributes: the parameters where ``attrs`` names them
    weight: nn.Parameter
    bias: nn.Parameter
    e_score_correction_bias: nn.Parameter
    w13_weight: nn.Parameter
    w2_weight: nn.Parameter

    def __init__(self, rl: RankLayout, prefix: str, attrs: Sequence[str], device: torch.device) -> None:
        super().__init__()
        _hold(self, rl, prefix, attrs, device)
        self.fp8: dict[str, tuple[Fp8Format, torch.dtype]] = {}
        self.gemm: set[str] = set()

    def dense(self, attr: str = "weight", expert: int | None = None) -> torch.Tensor:
        """``attr`` (``expert``: that matrix of a stack) as the math reads it: dequantized where
        this leaf holds it in FP8."""
        w: torch.Tensor = self.get_parameter(attr)
        w = w if expert is None else w[expert]
        held = self.fp8.get(attr)
        if held is None:
            return w
        fmt, dtype = held
        s = self.get_parameter(attr + fmt.scale_suffix)
        return dequantize(w, s if expert is None else s[expert], fmt, dtype)

    def linear(self, x: torch.Tensor, attr: str = "weight", bias: torch.Tensor | None = None,
               expert: int | None = None) -> torch.Tensor:
        """``x @ attr.T (+ bias)`` (``expert``: that matrix of a stack): by the FP8 GEMM on the
        served e4m3 bytes and scales where ``gemm`` holds ``attr``, else on ``dense``."""
        if attr not in self.gemm:
            return F.linear(x, self.dense(attr, expert), bias)
        q, s = self.get_parameter(attr), self.get_parameter(attr + self.fp8[attr][0].scale_suffix)
        return scaled_linear(x, q if expert is None else q[expert], s if expert is None else s[expert], bias)

    def quantize_(self, attr: str, fmt: Fp8Format, dtype: torch.dtype, scale_shape: tuple[int, ...],
                  gemm: bool = False) -> None:
        """Hold ``attr`` in FP8 from now on (zeroed, its scale after the leaf's other parameters);
        ``gemm``: compute with it by the FP8 GEMM where ``models.fp8_gemm`` can."""
        w = self.get_parameter(attr)
        self.register_parameter(attr, nn.Parameter(torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device=w.device),
                                                   requires_grad=False))
        scale = torch.zeros(scale_shape, dtype=torch.float32, device=w.device)
        self.register_parameter(attr + fmt.scale_suffix, nn.Parameter(scale, requires_grad=False))
        self.fp8[attr] = (fmt, dtype)
        if gemm and scaled(fmt, tuple(w.shape[-2:]), w.device):
            self.gemm.add(attr)


class GqaAttention(nn.Module):
    """Grouped-query attention on one rank's heads.  ``gate`` (Qwen3-Next): each head's q rows
    are its query then its output gate; the output is scaled by the gate's sigmoid.  ``lora``:
    the adapter's terms on q/k/v/o (set by the model when it serves one)."""

    lora: LoraTerm | None = None

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: TP,
                 device: torch.device, *, gate: bool = False) -> None:
        super().__init__()
        self.spec, self.tp, self.gate = spec, tp, gate
        qkv_attrs = ("weight", "bias") if spec.qkv_bias else ("weight",)
        self.qkv_proj = Leaf(rl, prefix + "qkv_proj", qkv_attrs, device)
        if spec.qk_norm:
            self.q_norm = Leaf(rl, prefix + "q_norm", ("weight",), device)
            self.k_norm = Leaf(rl, prefix + "k_norm", ("weight",), device)
        self.o_proj = Leaf(rl, prefix + "o_proj", ("weight",), device)
        d = spec.head_dim
        self.nq = spec.num_heads // tp.size
        self.nkv = (self.qkv_proj.weight.shape[0] // d - self.nq * (2 if gate else 1)) // 2
        self.k_dim = self.v_dim = d  # what a KV cache holds per kv head

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, layer: int) -> torch.Tensor:
        b, s, _ = x.shape
        d, eps = self.spec.head_dim, self.spec.rms_norm_eps
        qkv = self.qkv_proj.linear(x, bias=self.qkv_proj.get_parameter("bias") if self.spec.qkv_bias else None)
        nq = self.nq * (2 if self.gate else 1)
        q, k, v = qkv.split([nq * d, self.nkv * d, self.nkv * d], dim=-1)
        if self.lora is not None:
            q, k, v = (self.lora.add(t, x, y) for t, y in (("q_proj", q), ("k_proj", k), ("v_proj", v)))
        q, k, v = q.view(b, s, -1, d), k.view(b, s, -1, d), v.view(b, s, -1, d)
        gate = None
        if self.gate:
            q, gate = q.view(b, s, self.nq, 2 * d).chunk(2, dim=-1)
        if self.spec.qk_norm:
            off = self.spec.norm_offset
            q = rms_norm(q, self.q_norm.weight, eps, off)
            k = rms_norm(k, self.k_norm.weight, eps, off)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = (apply_rope(t, cos, sin, self.spec.rope_interleaved) for t in (q, k))
        start = 0
        if cache is not None:
            start = cache.length
            cache.keys[layer][:, :, start:start + s] = k
            cache.values[layer][:, :, start:start + s] = v
            k = cache.keys[layer][:, :, :start + s]
            v = cache.values[layer][:, :, :start + s]
        out = attention(q, k, v, causal_offset=start)
        out = out.transpose(1, 2).reshape(b, s, self.nq * d)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        y = self.o_proj.linear(out)
        return self.tp.all_reduce(y if self.lora is None else self.lora.add("o_proj", out, y))


class _LinearAttention(nn.Module):
    """One rank's gated DeltaNet (``linear_attn``, ``models.deltanet``): whole key-head groups,
    ``out_proj`` row-parallel.  ``interleaved``: the rank's projections keep the checkpoint's
    per-group order (Qwen3-Next), else they stack ``[q | k | v | z]`` and ``[b | a]`` (Qwen3.5)."""

    nkv = k_dim = v_dim = 0  # nothing in the KV cache: the cache carries its state (``KVCache.linear``)

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: TP, device: torch.device, *,
                 interleaved: bool) -> None:
        super().__init__()
        self.spec, self.tp, self.interleaved = spec, tp, interleaved
        _hold(self, rl, prefix.removesuffix("."), ("dt_bias", "A_log"), device)
        self.in_proj_qkvz = Leaf(rl, prefix + "in_proj_qkvz", ("weight",), device)
        self.in_proj_ba = Leaf(rl, prefix + "in_proj_ba", ("weight",), device)
        self.conv1d = Leaf(rl, prefix + "conv1d", ("weight",), device)
        self.norm = Leaf(rl, prefix + "norm", ("weight",), device)
        self.out_proj = Leaf(rl, prefix + "out_proj", ("weight",), device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer: int) -> torch.Tensor:
        weights = DeltaWeights(self.in_proj_qkvz.dense(), self.in_proj_ba.dense(), self.conv1d.weight,
                               self.get_parameter("dt_bias"), self.get_parameter("A_log"), self.norm.weight,
                               self.out_proj.dense())
        state = cache.linear[layer] if cache is not None else None
        out, state = deltanet(self.spec, x, weights, interleaved=self.interleaved, state=state)
        if cache is not None:
            cache.linear[layer] = state
        return self.tp.all_reduce(out)


class MLP(nn.Module):
    """Gated MLP split over TP; ``reduce=False`` returns this rank's partial sum (shared experts);
    ``lora``: the adapter's terms on gate/up/down."""

    lora: LoraTerm | None = None

    def __init__(self, rl: RankLayout, prefix: str, tp: TP, device: torch.device, *, reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.gate_up_proj = Leaf(rl, prefix + "gate_up_proj", ("weight",), device)
        self.down_proj = Leaf(rl, prefix + "down_proj", ("weight",), device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.linear(x).chunk(2, dim=-1)
        if self.lora is not None:
            gate, up = self.lora.add("gate_proj", x, gate), self.lora.add("up_proj", x, up)
        act = F.silu(gate) * up
        y = self.down_proj.linear(act)
        if self.lora is not None:
            y = self.lora.add("down_proj", act, y)
        return self.tp.all_reduce(y) if self.reduce else y


class _Experts(nn.Module):
    """A sparse layer's ``mlp``: router ``gate`` and the rank's ``experts`` stacks (FusedMoE)."""

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: TP, ep: int,
                 device: torch.device) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.sigmoid = spec.router == "sigmoid"
        self.gate = Leaf(rl, prefix + "gate", ("weight", "e_score_correction_bias") if self.sigmoid else ("weight",),
                          device)
        self.experts = Leaf(rl, prefix + "experts", ("w13_weight", "w2_weight"), device)
        # the shared expert under the family's engine name, and its sigmoid gate (Qwen3-Next)
        self.shared: tuple[MLP, Leaf | None] | None = None
        if spec.shared_expert_intermediate_size:
            where = spec.family_table.moe.shared if spec.family_table.moe is not None else None
            assert where is not None
            mlp = MLP(rl, f"{prefix}{where.module}.", tp, device, reduce=False)
            self.add_module(where.module, mlp)
            gate = Leaf(rl, prefix + "shared_expert_gate", ("weight",), device) if where.gated else None
            if gate is not None:
                self.add_module("shared_expert_gate", gate)
            self.shared = (mlp, gate)
        self.first = tp.rank // (tp.size // ep) * self.experts.w13_weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        bias = self.gate.e_score_correction_bias if self.sigmoid else None
        weights, chosen = route(self.spec, router_logits(self.spec, flat, self.gate.weight), bias)
        out = torch.zeros_like(flat)
        for k in range(self.experts.w13_weight.shape[0]):
            tok, slot = torch.nonzero(chosen == self.first + k, as_tuple=True)
            if tok.numel():
                gate, up = self.experts.linear(flat[tok], "w13_weight", expert=k).chunk(2, dim=-1)
                y = self.experts.linear(F.silu(gate) * up, "w2_weight", expert=k)
                out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        if self.shared is not None:  # its TP partial joins the same all-reduce
            mlp, shared_gate = self.shared
            y = mlp(flat)
            out = out + (y * torch.sigmoid(F.linear(flat, shared_gate.weight)) if shared_gate is not None else y)
        return self.tp.all_reduce(out).view_as(x)


def _latent(kind: Attention) -> Callable[[ModelSpec, RankLayout, str, TP, torch.device, Baton], LatentAttention]:
    def build(spec: ModelSpec, rl: RankLayout, prefix: str, tp: TP, device: torch.device,
              baton: Baton) -> LatentAttention:
        return LatentAttention(spec, prefix, tp.size, lambda name, attrs: Leaf(rl, name, attrs, device),
                               tp.all_reduce, kind=kind, baton=baton)
    return build


_AttentionModule = GqaAttention | LatentAttention | _LinearAttention


@dataclass(frozen=True)
class _AttentionKind:
    # (spec, rank layout, prefix of its tensors, tp, device, the model's baton) -> the module
    build: Callable[[ModelSpec, RankLayout, str, TP, torch.device, Baton], _AttentionModule]
    module: str  # the layer's attribute holding it; "": its tensors sit on the layer itself


def _gqa(gate: bool) -> Callable[[ModelSpec, RankLayout, str, TP, torch.device, Baton], _AttentionModule]:
    return lambda spec, rl, prefix, tp, device, baton: GqaAttention(spec, rl, prefix, tp, device, gate=gate)


def _gdn(interleaved: bool) -> Callable[[ModelSpec, RankLayout, str, TP, torch.device, Baton], _AttentionModule]:
    return lambda spec, rl, prefix, tp, device, baton: _LinearAttention(spec, rl, prefix, tp, device,
                                                                        interleaved=interleaved)


# the family's attention block (``Block.kind``) -> the module that computes it on one TP rank
ATTENTION: dict[Attention | None, _AttentionKind] = {
    Attention.GQA: _AttentionKind(_gqa(False), "self_attn"),
    # SGLang's Qwen3-Next / Qwen3.5 attention layer holds its tensors itself (no ``self_attn.``)
    Attention.GQA_GATED: _AttentionKind(_gqa(True), ""),
    Attention.GDN: _AttentionKind(_gdn(True), "linear_attn"),
    Attention.GDN_STACKED: _AttentionKind(_gdn(False), "linear_attn"),
    **{kind: _AttentionKind(_latent(kind), "self_attn") for kind in (Attention.MLA, Attention.DSA,
                                                                     Attention.DSA_SHARED)},
}


class Layer(nn.Module):
    def __init__(self, spec: ModelSpec, rl: RankLayout, layer: int, tp: TP, ep: int,
                 device: torch.device, baton: Baton) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        self.eps, self.offset, self.index = spec.rms_norm_eps, spec.norm_offset, layer
        self.input_layernorm = Leaf(rl, p + "input_layernorm", ("weight",), device)
        kind = spec.family_table.blocks(spec, layer)[0].kind
        if kind not in ATTENTION:
            raise NotImplementedError(f"{spec.name}: the reference engine does not compute {kind} attention (layer "
                                      f"{layer}) yet; shardsync plans and syncs this family, the reference models "
                                      f"run {sorted(str(k) for k in ATTENTION)}")
        where = ATTENTION[kind]
        attn = where.build(spec, rl, f"{p}{where.module}." if where.module else p, tp, device, baton)
        if where.module:
            self.add_module(where.module, attn)
        else:  # the attention's leaves are the layer's own; the module only computes
            for name, leaf in attn.named_children():
                self.add_module(name, leaf)
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, KVCache | None, int], torch.Tensor] = \
            attn.forward
        self.kv = (attn.nkv, attn.k_dim, attn.v_dim)  # what the KV cache holds per layer
        if spec.post_norms:  # GLM4
            self.post_self_attn_layernorm = Leaf(rl, p + "post_self_attn_layernorm", ("weight",), device)
        self.post_attention_layernorm = Leaf(rl, p + "post_attention_layernorm", ("weight",), device)
        self.mlp = (_Experts(spec, rl, p + "mlp.", tp, ep, device) if spec.sparse_layer(layer)
                    else MLP(rl, p + "mlp.", tp, device))
        if spec.post_norms:
            self.post_mlp_layernorm = Leaf(rl, p + "post_mlp_layernorm", ("weight",), device)
        self.post_norms = spec.post_norms

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None) -> torch.Tensor:
        a = self.attend(rms_norm(h, self.input_layernorm.weight, self.eps, self.offset), cos, sin, cache, self.index)
        if self.post_norms:
            a = rms_norm(a, self.post_self_attn_layernorm.weight, self.eps)
        h = h + a
        m = self.mlp(rms_norm(h, self.post_attention_layernorm.weight, self.eps, self.offset))
        if self.post_norms:
            m = rms_norm(m, self.post_mlp_layernorm.weight, self.eps)
        return h + m


class Decoder(nn.Module):
    """The ``model.`` prefix: embedding, layers, final norm."""

    def __init__(self, spec: ModelSpec, rl: RankLayout, tp: TP, ep: int, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = Leaf(rl, "model.embed_tokens", ("weight",), device)
        baton = Baton()  # sparse attention: the last indexer choice, for the layers that reuse it
        self.layers = nn.ModuleList(Layer(spec, rl, i, tp, ep, device, baton) for i in range(spec.num_layers))
        self.norm = Leaf(rl, "model.norm", ("weight",), device)
