"""The reference rollout engine: a tensor-parallel dense decoder holding the engine layout.

Parameters are exactly ``engine_layout(spec, EngineParallel(tp=tp_size)).ranks[tp_rank]``
(SGLang names and local shapes), so a sync runtime can write into them in place through
``named_parameters()`` / ``get_parameter``.  The math is ``shardsync.models.ops`` (written to
match ``transformers``); the TP scheme is SGLang's:

- vocab-parallel embedding: rank ``r`` looks up padded rows ``[r*P, (r+1)*P)``, other ids
  give zeros, then all-reduce;
- column-parallel ``qkv_proj`` / ``gate_up_proj`` (no communication);
- row-parallel ``o_proj`` / ``down_proj`` followed by an all-reduce;
- experts (sparse layers): the replicated router picks each token's top-k experts on every
  rank; a rank runs its own experts (EP block ``r // moe_tp``) on their MoE-TP slice and the
  partial outputs meet in the same all-reduce (SGLang's FusedMoE without a dispatcher);
- LM head: local logits, all-gather along the vocab, truncate to ``spec.vocab_size``.

Collective contract: every method that runs the model (``forward``, ``generate``,
``score``) is collective over the TP group.  All ranks call it in the same order with the
same arguments; each returns the same result on every rank.  With ``tp_size == 1`` and
``group=None`` nothing communicates.

Over 400 lines on purpose: one model, its TP scheme and its decoding loop read best side by
side (the layer math lives in ``models.ops``); the next family split goes into the family tables.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsync.dtypes import torch_dtype
from shardsync.family.section import Indexer
from shardsync.family.table import Attention
from shardsync.layout import EngineParallel, Layout, RankLayout, engine_layout
from shardsync.lora import Lora, engine_adapter_layout
from shardsync.models.deltanet import DeltaState, DeltaWeights, deltanet
from shardsync.models.fp8_gemm import scaled, scaled_linear
from shardsync.models.latent import Baton, LatentAttention
from shardsync.models.lora import LoraTerm, LoraWeights, engine_terms
from shardsync.models.ops import apply_rope, attention, rms_norm, rope_cos_sin, route, router_logits
from shardsync.models.weights import TensorSource, load_rank
from shardsync.piece import addressed
from shardsync.quant import Fp8Format, dequantize, fp8_format, quantize, quantized
from shardsync.spec import DTYPES, ModelSpec

log = logging.getLogger(__name__)

Generation = tuple[list[int], list[float]]


@dataclass
class KVCache:
    """Per-layer keys/values ``[batch, local kv heads, capacity, head_dim]``, filled to ``length``
    (empty on linear-attention layers); sparse attention's indexer keys ``[batch, capacity,
    index_head_dim]`` per layer too; linear attention's carried state per layer (None before
    the first step and on other layers)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    index_keys: list[torch.Tensor] = field(default_factory=list)
    linear: list[DeltaState | None] = field(default_factory=list)
    length: int = 0
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = self.keys[0].shape[2] if self.keys else 0


@dataclass
class Decoding:
    """One sequence being generated: its sampling settings, tokens so far and KV cache.
    ``cache = None`` means the next step prefills prompt + tokens (a new sequence, or one
    whose cache was built on weights that have since changed)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: set[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: KVCache | None = None
    done: bool = False


class _TP:
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


class _Leaf(nn.Module):
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


class _Attention(nn.Module):
    """Grouped-query attention on one rank's heads.  ``gate`` (Qwen3-Next): each head's q rows
    are its query then its output gate; the output is scaled by the gate's sigmoid.  ``lora``:
    the adapter's terms on q/k/v/o (set by the model when it serves one)."""

    lora: LoraTerm | None = None

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: _TP,
                 device: torch.device, *, gate: bool = False) -> None:
        super().__init__()
        self.spec, self.tp, self.gate = spec, tp, gate
        qkv_attrs = ("weight", "bias") if spec.qkv_bias else ("weight",)
        self.qkv_proj = _Leaf(rl, prefix + "qkv_proj", qkv_attrs, device)
        if spec.qk_norm:
            self.q_norm = _Leaf(rl, prefix + "q_norm", ("weight",), device)
            self.k_norm = _Leaf(rl, prefix + "k_norm", ("weight",), device)
        self.o_proj = _Leaf(rl, prefix + "o_proj", ("weight",), device)
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

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: _TP, device: torch.device, *,
                 interleaved: bool) -> None:
        super().__init__()
        self.spec, self.tp, self.interleaved = spec, tp, interleaved
        _hold(self, rl, prefix.removesuffix("."), ("dt_bias", "A_log"), device)
        self.in_proj_qkvz = _Leaf(rl, prefix + "in_proj_qkvz", ("weight",), device)
        self.in_proj_ba = _Leaf(rl, prefix + "in_proj_ba", ("weight",), device)
        self.conv1d = _Leaf(rl, prefix + "conv1d", ("weight",), device)
        self.norm = _Leaf(rl, prefix + "norm", ("weight",), device)
        self.out_proj = _Leaf(rl, prefix + "out_proj", ("weight",), device)

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


class _MLP(nn.Module):
    """Gated MLP split over TP; ``reduce=False`` returns this rank's partial sum (shared experts);
    ``lora``: the adapter's terms on gate/up/down."""

    lora: LoraTerm | None = None

    def __init__(self, rl: RankLayout, prefix: str, tp: _TP, device: torch.device, *, reduce: bool = True) -> None:
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.gate_up_proj = _Leaf(rl, prefix + "gate_up_proj", ("weight",), device)
        self.down_proj = _Leaf(rl, prefix + "down_proj", ("weight",), device)

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

    def __init__(self, spec: ModelSpec, rl: RankLayout, prefix: str, tp: _TP, ep: int,
                 device: torch.device) -> None:
        super().__init__()
        self.spec, self.tp = spec, tp
        self.sigmoid = spec.router == "sigmoid"
        self.gate = _Leaf(rl, prefix + "gate", ("weight", "e_score_correction_bias") if self.sigmoid else ("weight",),
                          device)
        self.experts = _Leaf(rl, prefix + "experts", ("w13_weight", "w2_weight"), device)
        # the shared expert under the family's engine name, and its sigmoid gate (Qwen3-Next)
        self.shared: tuple[_MLP, _Leaf | None] | None = None
        if spec.shared_expert_intermediate_size:
            where = spec.family_table.moe.shared if spec.family_table.moe is not None else None
            assert where is not None
            mlp = _MLP(rl, f"{prefix}{where.module}.", tp, device, reduce=False)
            self.add_module(where.module, mlp)
            gate = _Leaf(rl, prefix + "shared_expert_gate", ("weight",), device) if where.gated else None
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


def _latent(kind: Attention) -> Callable[[ModelSpec, RankLayout, str, _TP, torch.device, Baton], LatentAttention]:
    def build(spec: ModelSpec, rl: RankLayout, prefix: str, tp: _TP, device: torch.device,
              baton: Baton) -> LatentAttention:
        return LatentAttention(spec, prefix, tp.size, lambda name, attrs: _Leaf(rl, name, attrs, device),
                               tp.all_reduce, kind=kind, baton=baton)
    return build


_AttentionModule = _Attention | LatentAttention | _LinearAttention


@dataclass(frozen=True)
class _AttentionKind:
    # (spec, rank layout, prefix of its tensors, tp, device, the model's baton) -> the module
    build: Callable[[ModelSpec, RankLayout, str, _TP, torch.device, Baton], _AttentionModule]
    module: str  # the layer's attribute holding it; "": its tensors sit on the layer itself


def _gqa(gate: bool) -> Callable[[ModelSpec, RankLayout, str, _TP, torch.device, Baton], _AttentionModule]:
    return lambda spec, rl, prefix, tp, device, baton: _Attention(spec, rl, prefix, tp, device, gate=gate)


def _gdn(interleaved: bool) -> Callable[[ModelSpec, RankLayout, str, _TP, torch.device, Baton], _AttentionModule]:
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


class _Layer(nn.Module):
    def __init__(self, spec: ModelSpec, rl: RankLayout, layer: int, tp: _TP, ep: int,
                 device: torch.device, baton: Baton) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        self.eps, self.offset, self.index = spec.rms_norm_eps, spec.norm_offset, layer
        self.input_layernorm = _Leaf(rl, p + "input_layernorm", ("weight",), device)
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
            self.post_self_attn_layernorm = _Leaf(rl, p + "post_self_attn_layernorm", ("weight",), device)
        self.post_attention_layernorm = _Leaf(rl, p + "post_attention_layernorm", ("weight",), device)
        self.mlp = (_Experts(spec, rl, p + "mlp.", tp, ep, device) if spec.sparse_layer(layer)
                    else _MLP(rl, p + "mlp.", tp, device))
        if spec.post_norms:
            self.post_mlp_layernorm = _Leaf(rl, p + "post_mlp_layernorm", ("weight",), device)
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


class _Decoder(nn.Module):
    """The ``model.`` prefix: embedding, layers, final norm."""

    def __init__(self, spec: ModelSpec, rl: RankLayout, tp: _TP, ep: int, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = _Leaf(rl, "model.embed_tokens", ("weight",), device)
        baton = Baton()  # sparse attention: the last indexer choice, for the layers that reuse it
        self.layers = nn.ModuleList(_Layer(spec, rl, i, tp, ep, device, baton) for i in range(spec.num_layers))
        self.norm = _Leaf(rl, "model.norm", ("weight",), device)


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {DTYPES}")
    return name


def prompt_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"generate:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> int:
    """One token from 1-D ``logits``: argmax when ``temperature == 0``, else nucleus sampling.

    Top-p keeps the smallest prefix of tokens (by descending probability, ties by index)
    whose mass reaches ``top_p``; the first token is always kept.
    """
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        choice = torch.multinomial(sorted_p * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))


class EngineModel(nn.Module):
    """One TP rank of the reference engine (see the module docstring for the TP scheme).

    ``named_parameters()`` yields exactly the rank's engine-layout tensors, in layout order;
    they start zeroed (padding rows stay zero) and are filled by ``load_source`` or a sync.
    ``group`` is the TP process group (required when ``tp_size > 1``; its rank must equal
    ``tp_rank``).  Activations run in ``dtype``; logits are returned in float32.  ``ep``: expert
    parallel within the TP group (mixture-of-experts models).  ``quantization``: an FP8 format
    (``quant.FORMATS``): the linear weights ``quant.targets`` names are held in e4m3 with their
    scales (SGLang's names and shapes), multiplied by the FP8 GEMM where the GPU has it
    (``models.fp8_gemm``; ``fp8_gemm=False``: never) and dequantized elsewhere.  ``lora``: the engine serves
    that adapter on top of its base: ``adapter`` holds the rank's adapter tensors (zeroed, PEFT's
    names) and every adapted linear adds its low-rank term; a sync then writes the adapter
    (``synced_tensors``) and the base stays as loaded.  ``lora_merge``: no low-rank term; the
    engine serves base + ``scale * B @ A`` merged into its base shard (``receiver.merged``).
    """

    def __init__(self, spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", *, ep: int = 1, quantization: str | None = None,
                 lora: Lora | None = None, lora_merge: bool = False, fp8_gemm: bool = True) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} tp_size={tp_size}")
        if tp_size > 1:
            if group is None:
                raise ValueError(f"tp_size={tp_size} needs the TP process group; pass group=")
            if dist.get_world_size(group) != tp_size or dist.get_rank(group) != tp_rank:
                raise ValueError(
                    f"group has size {dist.get_world_size(group)} and this process is its rank "
                    f"{dist.get_rank(group)}, but tp_size={tp_size} tp_rank={tp_rank}"
                )
        self.spec = spec
        self.device = torch.device(device)
        self.ep = ep
        self.layout: Layout = engine_layout(spec, EngineParallel(tp=tp_size, ep=ep, dtype=_dtype_name(dtype)))
        self.tp = _TP(group, tp_rank, tp_size)
        rl = self.layout.ranks[tp_rank]
        self.model = _Decoder(spec, rl, self.tp, ep, self.device)
        if not spec.tie_word_embeddings:
            self.lm_head = _Leaf(rl, "lm_head", ("weight",), self.device)
        self.dtype = torch_dtype(_dtype_name(dtype))
        self.vocab_rows = rl.tensor("model.embed_tokens.weight").shape[0]
        got = [(n, tuple(p.shape)) for n, p in self.named_parameters()]
        assert got == [(t.name, t.stored) for t in rl.tensors], "parameters diverge from layout"
        self.quantization = None if quantization is None else fp8_format(quantization)
        self.targets = {} if self.quantization is None else quantized(rl, spec, self.quantization)
        for name, target in self.targets.items():
            assert self.quantization is not None  # targets only with a format
            leaf, attr = name.rsplit(".", 1)
            held = self.get_submodule(leaf)
            assert isinstance(held, _Leaf), f"{name}: FP8 weights live on leaves"
            held.quantize_(attr, self.quantization, self.dtype, target.scale_shape, gemm=fp8_gemm)
        self.lora, self.lora_merge = lora, lora_merge and lora is not None
        self.adapter: LoraWeights | None = None
        if lora is not None:
            par = EngineParallel(tp=tp_size, ep=ep, dtype=_dtype_name(dtype))
            self.adapter_layout = engine_adapter_layout(spec, lora, par)
        if lora is not None and not lora_merge:
            self.adapter = LoraWeights(self.adapter_layout.ranks[tp_rank], self.device)
            for i, layer in enumerate(self.model.layers):
                terms = engine_terms(self.adapter, lora, i)
                cast(_Attention, layer.self_attn).lora = terms  # ``lora.check_lora``: GQA attention, dense MLPs
                if isinstance(layer.mlp, _MLP):
                    layer.mlp.lora = terms

    def gemm_weights(self) -> list[str]:
        """The FP8 weights this rank multiplies by the FP8 GEMM (``models.fp8_gemm``), not dequantized."""
        return [f"{name}.{attr}" for name, leaf in self.named_modules() if isinstance(leaf, _Leaf)
                for attr in sorted(leaf.gemm)]

    def synced_tensors(self) -> dict[str, torch.Tensor]:
        """What a sync writes, by layout name: the adapter's tensors when serving one, else every
        parameter of the model."""
        if self.adapter is not None:
            return self.adapter.tensors()
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_adapter(self, source: TensorSource) -> None:
        """Overwrite the adapter in place with this rank's pieces of ``source`` (its PEFT tensors)."""
        assert self.adapter is not None, "load_adapter needs an engine built with lora="
        tensors = load_rank(self.adapter_layout, self.tp.rank, source, device=self.device)
        for name, t in self.adapter.tensors().items():
            t.copy_(tensors[name])

    @classmethod
    def from_source(cls, spec: ModelSpec, source: TensorSource, tp_rank: int = 0, tp_size: int = 1,
                    group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device = "cpu", *, ep: int = 1,
                    quantization: str | None = None, lora: Lora | None = None,
                    lora_merge: bool = False, fp8_gemm: bool = True) -> EngineModel:
        """Build rank ``tp_rank`` and fill it from ``source`` (``random_source``, ``checkpoint_source``);
        an adapter (``lora``) starts zeroed, as PEFT's ``B`` does: the base model's outputs."""
        model = cls(spec, tp_rank, tp_size, group, dtype, device, ep=ep, quantization=quantization, lora=lora,
                    lora_merge=lora_merge, fp8_gemm=fp8_gemm)
        model.load_source(source)
        return model

    @torch.no_grad()
    def load_source(self, source: TensorSource) -> None:
        """Overwrite every parameter in place with this rank's pieces of ``source`` (local, no comm);
        an FP8 engine quantizes its shard of each quantized weight."""
        tensors = load_rank(self.layout, self.tp.rank, source, device=self.device)
        rl = self.layout.ranks[self.tp.rank]
        params = dict(self.named_parameters())
        for t in rl.tensors:
            target = self.targets.get(t.name)
            if target is None:
                addressed(params[t.name], t).copy_(tensors[t.name])
                continue
            assert self.quantization is not None
            q, scale = quantize(tensors[t.name].view(target.shape), self.quantization)
            params[t.name].copy_(q)
            params[target.scale].copy_(scale)
        log.debug("tp%d: loaded %d tensors", self.tp.rank, len(tensors))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``capacity`` positions."""
        kv = [cast(_Layer, layer).kv for layer in self.model.layers]
        n = self.spec.num_layers
        ix = self.spec.find(Indexer)  # sparse attention: each layer's indexer keys
        index = (batch, capacity, ix.index_head_dim if ix is not None else 0)
        return KVCache(
            keys=[torch.zeros(batch, h, capacity, k, dtype=self.dtype, device=self.device) for h, k, _ in kv],
            values=[torch.zeros(batch, h, capacity, v, dtype=self.dtype, device=self.device) for h, _, v in kv],
            index_keys=[torch.zeros(index, dtype=self.dtype, device=self.device)
                        for _ in range(n if ix is not None else 0)],
            linear=[None] * n,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        lo = self.tp.rank * self.vocab_rows
        local = ids - lo
        mine = (local >= 0) & (local < self.vocab_rows)
        h = F.embedding(local.clamp(0, self.vocab_rows - 1), self.model.embed_tokens.weight)
        return self.tp.all_reduce(h.masked_fill(~mine[..., None], 0))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Float32 logits ``[B, S, vocab_size]`` for ``input_ids`` ``[B, S]`` (collective).

        Without a cache the tokens sit at positions ``0..S-1``.  With one they continue it
        (positions ``cache.length + 0..S-1``; prefill an empty cache, then decode one token
        at a time) and the cache grows by ``S``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        ids = input_ids.to(self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.spec.vocab_size})")
        b, s = ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None and start + s > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; {start} + {s} do not fit")
        positions = torch.arange(start, start + s, device=self.device).expand(b, s)
        cos, sin = rope_cos_sin(self.spec, positions, self.dtype)
        h = self._embed(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache)
        if cache is not None:
            cache.length += s
        h = rms_norm(h, self.model.norm.weight, self.spec.rms_norm_eps, self.spec.norm_offset)
        head = self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        logits = self.tp.all_gather_last(F.linear(h, head.weight))
        return logits[..., : self.spec.vocab_size].float()

    def _check_tokens(self, seqs: Sequence[Sequence[int]], what: str) -> None:
        for i, seq in enumerate(seqs):
            if not seq:
                raise ValueError(f"{what} {i} is empty; it needs at least one token")
            if min(seq) < 0 or max(seq) >= self.spec.vocab_size:
                raise ValueError(f"{what} {i} has token ids outside [0, {self.spec.vocab_size})")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, *,
                 stop_token_ids: Sequence[int] = ()) -> list[Generation]:
        """Sample up to ``max_new_tokens`` after each prompt: ``[(new tokens, logprobs)]`` (collective).

        Greedy when ``temperature == 0``.  Prompt ``i`` samples from its own CPU generator
        seeded from ``(seed, i)``, so results do not depend on batching or on the TP size
        beyond float rounding.  Every rank samples, then group rank 0's token is broadcast so
        ranks can never diverge.  A logprob is that of the chosen token under the policy's
        plain distribution, ``log_softmax(raw logits)``: not temperature- or top-p-adjusted,
        so it equals ``score()`` of the same sequence.  Generation stops after a token in
        ``stop_token_ids`` (which is returned).  Prompts run one at a time; ``start`` and
        ``step`` are the same thing one token at a time (the engine's scheduler uses them).
        """
        seqs = [self.start(p, max_new_tokens, temperature, top_p, prompt_seed(seed, i),
                           stop_token_ids=stop_token_ids) for i, p in enumerate(prompts)]
        for seq in seqs:
            while not seq.done:
                self.step(seq)
        return [(seq.tokens, seq.logprobs) for seq in seqs]

    def start(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
              top_p: float = 1.0, seed: int = 0, *, stop_token_ids: Sequence[int] = ()) -> Decoding:
        """A sequence ready to decode (no forward yet: every token's forward runs in its own
        ``step``, so the weights a token was sampled from are the ones of that step)."""
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_tokens([prompt], "prompt")
        limit = self.spec.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings={limit}")
        return Decoding(list(prompt), max_new_tokens, temperature, top_p, set(stop_token_ids),
                        torch.Generator().manual_seed(seed), done=max_new_tokens == 0)

    def step(self, seq: Decoding) -> None:
        """One token for ``seq`` (collective): forward what the cache lacks, sample, append."""
        if seq.done:
            return
        if seq.cache is None:  # first step, or the cache was dropped (weights changed)
            seq.cache = self.new_cache(1, len(seq.prompt) + seq.max_new_tokens)
            feed = seq.prompt + seq.tokens
        else:
            feed = seq.tokens[-1:]
        last = self(torch.tensor([feed], dtype=torch.long), seq.cache)[0, -1].cpu()
        token = sample_token(last, seq.temperature, seq.top_p, seq.generator)
        picked = torch.tensor([token, float(torch.log_softmax(last, -1)[token])],
                              dtype=torch.float64, device=self.device)
        picked = self.tp.broadcast_from_first(picked)
        seq.tokens.append(int(picked[0]))
        seq.logprobs.append(float(picked[1]))
        seq.done = seq.tokens[-1] in seq.stop or len(seq.tokens) == seq.max_new_tokens
        if seq.done:
            seq.cache = None

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities of each token given the tokens before it (collective).

        Entry ``j`` of a result is ``log p(seq[j+1] | seq[:j+1])`` under ``log_softmax`` of
        the raw logits, so a sequence of ``n`` tokens gets ``n - 1`` values (the first token
        has no context and is omitted).
        """
        self._check_tokens(sequences, "sequence")
        out = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long)
            logp = torch.log_softmax(self(ids)[0, :-1], dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None].to(logp.device))[:, 0].tolist())
        return out
