"""The reference trainer's per-layer building blocks under Megatron-core's names: parameter holders
(``Weights``), a sparse layer's router and local experts, the attention modules with the table from a
family's attention kind to its module (``ATTENTION``), the decoder layer and the frozen MTP layer.
Each takes its tensors out of the rank's layout tensors and computes its share of the TP scheme that
``models.trainer`` describes; ``TrainerModel`` assembles them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from shardsync.family.table import Attention
from shardsync.models.deltanet import DeltaWeights, deltanet
from shardsync.models.latent import Baton, TrainerLatentAttention
from shardsync.models.lora import LoraTerm
from shardsync.models.ops import apply_rope, attention, rms_norm, route, router_logits
from shardsync.models.parallel import Comm
from shardsync.spec import ModelSpec

if TYPE_CHECKING:
    from shardsync.models.trainer import TrainerModel


def mark_tp(param: nn.Parameter, sharded: bool) -> None:
    """Megatron's attribute: sharded over TP (vs replicated on every TP rank)."""
    param.tensor_model_parallel = sharded  # type: ignore[attr-defined]  # Megatron's own, not in torch's stubs


class Weights(nn.Module):
    """The parameters ``<prefix>.<attr>`` of one Megatron module, taken from ``tensors``."""

    # read as attributes: the parameters where ``attrs`` names them, a shared expert's linears (``_Experts``)
    weight: nn.Parameter
    bias: nn.Parameter
    layer_norm_weight: nn.Parameter
    expert_bias: nn.Parameter
    gate_weight: nn.Parameter
    linear_fc1: Weights
    linear_fc2: Weights

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str, attrs: Sequence[str],
                 *, tp_sharded: bool) -> None:
        super().__init__()
        for attr in attrs:
            param = nn.Parameter(tensors.pop(f"{prefix}.{attr}"))
            mark_tp(param, tp_sharded and not attr.startswith("layer_norm"))
            self.register_parameter(attr, param)


_Make = Callable[[str, tuple[str, ...], bool], Weights]  # (name, attrs, TP-sharded) -> the parameters


class _Experts(nn.Module):
    """A sparse layer's ``mlp``: the router and this rank's local experts (both spellings)."""

    def __init__(self, model: TrainerModel, tensors: dict[str, torch.Tensor], prefix: str) -> None:
        super().__init__()
        spec, par = model.spec, model.par
        assert model.exchange is not None, "sparse layers need the model's expert exchange (_init_experts)"
        self.spec, self.dtype, self.exchange, self.tp = spec, model.compute_dtype, model.exchange, model.tp
        self.sigmoid = spec.router == "sigmoid"  # with Megatron's expert_bias (HF e_score_correction_bias)
        self.router = Weights(tensors, prefix + "router", ("weight", "expert_bias") if self.sigmoid else ("weight",),
                               tp_sharded=False)
        n = spec.num_experts // par.ep
        self.first = par.expert_coords(model.rank)[2] * n
        self.experts = nn.Module()
        if par.expert_names == "grouped":
            for fc in ("linear_fc1", "linear_fc2"):
                setattr(self.experts, fc, Weights(tensors, f"{prefix}experts.{fc}", [f"weight{j}" for j in range(n)],
                                                   tp_sharded=False))
            fc1, fc2 = cast(Weights, self.experts.linear_fc1), cast(Weights, self.experts.linear_fc2)
            self._local = [(fc1.get_parameter(f"weight{j}"), fc2.get_parameter(f"weight{j}")) for j in range(n)]
        else:
            self.experts.local_experts = nn.ModuleList()
            for j in range(n):
                m = nn.Module()
                for fc in ("linear_fc1", "linear_fc2"):
                    setattr(m, fc, Weights(tensors, f"{prefix}experts.local_experts.{j}.{fc}", ("weight",),
                                            tp_sharded=False))
                self.experts.local_experts.append(m)
            self._local = [(cast(Weights, m.linear_fc1).weight, cast(Weights, m.linear_fc2).weight)
                           for m in self.experts.local_experts]
        # Megatron's allreduce=False: reduced over the expert-DP group, counted apart in the norm
        model.expert_params.update(id(p) for p in self.experts.parameters())
        self.shared_gate = spec.family_table.moe is not None and spec.family_table.moe.shared.gated
        if spec.shared_expert_intermediate_size:  # a dense gated MLP split over TP (its gate replicated)
            self.shared_experts = Weights(tensors, prefix + "shared_experts",
                                           ("gate_weight",) if self.shared_gate else (), tp_sharded=False)
            for fc in ("linear_fc1", "linear_fc2"):
                setattr(self.shared_experts, fc, Weights(tensors, f"{prefix}shared_experts.{fc}", ("weight",),
                                                          tp_sharded=True))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype, ex, k = self.dtype, self.exchange, self.spec.num_experts_per_tok
        flat = h.reshape(-1, h.shape[-1])
        bias = self.router.expert_bias if self.sigmoid else None
        weights, chosen = route(self.spec, router_logits(self.spec, flat, self.router.weight.to(dtype)), bias)
        rows = ex.rows(flat.shape[0])
        if weights.dtype == flat.dtype:  # one gather for both
            tokens, weights = ex.gather(torch.cat([flat, weights], dim=-1), rows).split([flat.shape[-1], k], dim=-1)
        else:  # an fp32 router beside bf16 activations
            tokens, weights = ex.gather(flat, rows), ex.gather(weights, rows)
        chosen = ex.gather_ids(chosen, rows)
        # tied to the gathered tokens and weights even when none reach this rank's experts: every
        # member's backward then runs the exchange's collectives (else the others wait forever)
        out = tokens * 0.0 + (weights[:, :1] * 0.0).to(tokens.dtype)
        for j, (fc1, fc2) in enumerate(self._local):
            tok, slot = torch.nonzero(chosen == self.first + j, as_tuple=True)
            if tok.numel():
                gate, up = F.linear(tokens[tok], fc1.to(dtype)).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, fc2.to(dtype))
                out = out.index_add(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        out = ex.combine(out, rows)
        if self.spec.shared_expert_intermediate_size:
            s = self.shared_experts
            gate, up = F.linear(self.tp.copy_to(flat), s.linear_fc1.weight.to(dtype)).chunk(2, dim=-1)
            y = self.tp.reduce_from(F.linear(F.silu(gate) * up, s.linear_fc2.weight.to(dtype)))
            if self.shared_gate:  # computed whole on every TP rank from the replicated input
                y = y * torch.sigmoid(F.linear(flat, s.gate_weight.to(dtype)))
            out = out + y
        return out.view_as(h)


class GqaAttention(nn.Module):
    """Grouped-query attention under Megatron's names: the fused QKV column-parallel (its input
    norm fused in as ``layer_norm_weight`` under the TE spec), ``linear_proj`` row-parallel.
    ``gate`` (``attention_output_gate``): each group's rows hold its q heads, then their output
    gates, then k and v; the output is scaled by the gates' sigmoid.  ``lora``: the adapter's
    terms on q/k/v (added to each part of the fused output) and on ``linear_proj``."""

    lora: LoraTerm | None = None

    def __init__(self, spec: ModelSpec, prefix: str, tp: Comm, fused: bool, weights: _Make, *,
                 gate: bool = False) -> None:
        super().__init__()
        self.spec, self.tp, self.fused, self.gate = spec, tp, fused, gate
        p = prefix + "self_attention."
        norm = ("layer_norm_weight",) if fused else ()
        self.linear_qkv = weights(p + "linear_qkv", (*norm, "weight", *(("bias",) if spec.qkv_bias else ())), True)
        if spec.qk_norm:
            self.q_layernorm = weights(p + "q_layernorm", ("weight",), False)
            self.k_layernorm = weights(p + "k_layernorm", ("weight",), False)
        self.linear_proj = weights(p + "linear_proj", ("weight",), True)
        self.groups = spec.num_kv_heads // tp.size

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x``: the layer input under the TE spec (the norm is fused here), else already normed."""
        spec, tp, qkv = self.spec, self.tp, self.linear_qkv

        def w(weight: torch.Tensor) -> torch.Tensor:
            return weight.to(dtype)

        b, s, _ = x.shape
        d, p, eps, off = spec.head_dim, spec.heads_per_group, spec.rms_norm_eps, spec.norm_offset
        h = tp.copy_to(rms_norm(x, w(qkv.layer_norm_weight), eps, off) if self.fused else x)
        fused = F.linear(h, w(qkv.weight), w(qkv.bias) if spec.qkv_bias else None)
        # Local rows are whole query groups: [q heads of group, (their gates,) k, v] per group (LAYOUTS §4.2).
        g = p if self.gate else 0
        q, gate, k, v = fused.view(b, s, self.groups, p + g + 2, d).split([p, g, 1, 1], dim=3)
        q = q.reshape(b, s, self.groups * p, d)
        k, v = k.reshape(b, s, self.groups, d), v.reshape(b, s, self.groups, d)
        if self.lora is not None:  # this rank's heads, in order: the rows of its B shards
            q, k, v = (self.lora.add(t, h, y.reshape(b, s, -1)).view_as(y)
                       for t, y in (("q_proj", q), ("k_proj", k), ("v_proj", v)))
        if spec.qk_norm:
            # Replicated gains applied to this rank's heads only: their grads sum over TP.
            q = rms_norm(q, w(tp.copy_to(self.q_layernorm.weight)), eps, off)
            k = rms_norm(k, w(tp.copy_to(self.k_layernorm.weight)), eps, off)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = (apply_rope(t, cos, sin, spec.rope_interleaved) for t in (q, k))
        out = attention(q, k, v, causal_offset=0).transpose(1, 2).reshape(b, s, -1)
        if self.gate:
            out = out * torch.sigmoid(gate.reshape(b, s, -1))
        y = F.linear(out, w(self.linear_proj.weight))
        return tp.reduce_from(y if self.lora is None else self.lora.add("o_proj", out, y))


class _LinearAttention(nn.Module):
    """slime's linear-attention layer under ``self_attention.``: transformers' gated DeltaNet
    (``models.deltanet``), its input norm inside, **replicated** on every TP rank and computed
    whole there (no TP communication: every rank's gradients are the same).  ``interleaved``:
    Qwen3-Next's fused per-group projections, else Qwen3.5's four (stacked here)."""

    def __init__(self, spec: ModelSpec, prefix: str, weights: _Make, *, interleaved: bool) -> None:
        super().__init__()
        self.spec, self.interleaved = spec, interleaved
        p = prefix + "self_attention."
        self.input_layernorm = weights(p + "input_layernorm", ("weight",), False)
        self.linear_attn = weights(p + "linear_attn", ("dt_bias", "A_log"), False)
        self.projections = ("in_proj_qkvz", "in_proj_ba") if interleaved else (
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        for name in (*self.projections, "conv1d", "norm", "out_proj"):
            self.linear_attn.add_module(name, weights(f"{p}linear_attn.{name}", ("weight",), False))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x``: the layer input (this module holds the norm)."""
        spec, la = self.spec, self.linear_attn

        def w(name: str) -> torch.Tensor:
            return la.get_submodule(name).get_parameter("weight").to(dtype)

        h = rms_norm(x, self.input_layernorm.get_parameter("weight").to(dtype), spec.rms_norm_eps, spec.norm_offset)
        proj = [w(name) for name in self.projections]
        qkvz, ba = (proj[0], proj[1]) if self.interleaved else (torch.cat(proj[:2]), torch.cat(proj[2:]))
        weights = DeltaWeights(qkvz, ba, w("conv1d"), la.get_parameter("dt_bias"), la.get_parameter("A_log"),
                               w("norm"), w("out_proj"))
        return deltanet(spec, h, weights, interleaved=self.interleaved)[0]


@dataclass(frozen=True)
class _AttentionKind:
    # (spec, prefix, tp, fused norms, weights, layer, the model's baton) -> the module
    build: Callable[[ModelSpec, str, Comm, bool, _Make, int, Baton], nn.Module]
    fuses_input_norm: bool  # under the TE spec the layer's input norm lives in the first linear
    owns_input_norm: bool = False  # the layer's input norm lives in the module under either spec


def _latent(kind: Attention) -> _AttentionKind:
    def build(spec: ModelSpec, prefix: str, tp: Comm, fused: bool, weights: _Make, layer: int,
              baton: Baton) -> nn.Module:
        return TrainerLatentAttention(spec, prefix, tp, fused, weights, kind=kind, baton=baton, layer=layer)
    return _AttentionKind(build, fuses_input_norm=False)  # MLA: never fused


def _gqa(gate: bool) -> _AttentionKind:
    def build(spec: ModelSpec, prefix: str, tp: Comm, fused: bool, weights: _Make, layer: int,
              baton: Baton) -> nn.Module:
        return GqaAttention(spec, prefix, tp, fused, weights, gate=gate)
    return _AttentionKind(build, fuses_input_norm=True)


def _gdn(interleaved: bool) -> _AttentionKind:
    def build(spec: ModelSpec, prefix: str, tp: Comm, fused: bool, weights: _Make, layer: int,
              baton: Baton) -> nn.Module:
        return _LinearAttention(spec, prefix, weights, interleaved=interleaved)
    return _AttentionKind(build, fuses_input_norm=False, owns_input_norm=True)


# the family's attention block (``Block.kind``) -> its module under Megatron's names
ATTENTION: dict[Attention | None, _AttentionKind] = {
    Attention.GQA: _gqa(False), Attention.GQA_GATED: _gqa(True), Attention.GDN: _gdn(True),
    Attention.GDN_STACKED: _gdn(False),
    **{kind: _latent(kind) for kind in (Attention.MLA, Attention.DSA, Attention.DSA_SHARED)}}


class Layer(nn.Module):
    """One decoder layer under Megatron's names; both norm spellings (fused / separate).
    ``lora``: the adapter's terms on the dense MLP's gate/up/down."""

    lora: LoraTerm | None = None

    def __init__(self, model: TrainerModel, tensors: dict[str, torch.Tensor], prefix: str,
                 layer: int) -> None:
        super().__init__()
        spec = model.spec
        self.spec, self.tp, self.dtype = spec, model.tp, model.compute_dtype
        self.sparse = spec.sparse_layer(layer)
        self.fused = model.par.norm_names == "fused" and not self.sparse
        self.fused_attn = model.par.norm_names == "fused"
        name = spec.family_table.blocks(spec, layer)[0].kind
        if name not in ATTENTION:
            raise NotImplementedError(f"{spec.name}: the reference trainer does not compute {name} attention (layer "
                                      f"{layer}) yet; shardsync plans and syncs this family, the reference models "
                                      f"run {sorted(str(k) for k in ATTENTION)}")
        kind = ATTENTION[name]
        # the TE spec's fused norm, or one the attention module always holds
        self.norm_in_attention = kind.owns_input_norm or (self.fused_attn and kind.fuses_input_norm)
        if not self.norm_in_attention:
            self.input_layernorm = Weights(tensors, prefix + "input_layernorm", ("weight",),
                                            tp_sharded=False)
        self.self_attention = kind.build(spec, prefix, self.tp, self.fused_attn,
                                         lambda name, attrs, sharded: Weights(tensors, name, attrs,
                                                                               tp_sharded=sharded),
                                         layer, model.baton)
        self.post_norms = spec.post_norms  # GLM4: norms of the attention and MLP outputs
        if self.post_norms:
            self.post_self_attn_layernorm = Weights(tensors, prefix + "post_self_attn_layernorm", ("weight",),
                                                     tp_sharded=False)
        if not self.fused:
            self.pre_mlp_layernorm = Weights(tensors, prefix + "pre_mlp_layernorm", ("weight",),
                                              tp_sharded=False)
        if self.sparse:
            self.mlp: nn.Module = _Experts(model, tensors, prefix + "mlp.")
        else:
            self.mlp = nn.Module()
            norm = ("layer_norm_weight",) if self.fused else ()
            self.mlp.linear_fc1 = Weights(tensors, prefix + "mlp.linear_fc1", (*norm, "weight"),
                                           tp_sharded=True)
            self.mlp.linear_fc2 = Weights(tensors, prefix + "mlp.linear_fc2", ("weight",),
                                           tp_sharded=True)
        if self.post_norms:
            self.post_mlp_layernorm = Weights(tensors, prefix + "post_mlp_layernorm", ("weight",), tp_sharded=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        spec, dtype = self.spec, self.dtype

        def w(weight: torch.Tensor) -> torch.Tensor:
            return weight.to(dtype)

        eps = spec.rms_norm_eps
        h = x if self.norm_in_attention else rms_norm(x, w(self.input_layernorm.weight), eps, spec.norm_offset)
        a = self.self_attention(h, cos, sin, dtype)
        return self._mlp(x + (rms_norm(a, w(self.post_self_attn_layernorm.weight), eps) if self.post_norms else a))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        tp, dtype, mlp, eps, off = self.tp, self.dtype, self.mlp, self.spec.rms_norm_eps, self.spec.norm_offset

        def w(weight: torch.Tensor) -> torch.Tensor:
            return weight.to(dtype)

        if self.sparse:  # the exchange completes the activation gradient: no TP copy here
            return x + mlp(rms_norm(x, w(self.pre_mlp_layernorm.weight), eps, off))
        fc1, fc2 = cast(Weights, mlp.linear_fc1), cast(Weights, mlp.linear_fc2)  # the dense MLP's linears
        norm = fc1.layer_norm_weight if self.fused else self.pre_mlp_layernorm.weight
        h = tp.copy_to(rms_norm(x, w(norm), eps, off))
        gate, up = F.linear(h, w(fc1.weight)).chunk(2, dim=-1)
        if self.lora is not None:
            gate, up = self.lora.add("gate_proj", h, gate), self.lora.add("up_proj", h, up)
        act = F.silu(gate) * up
        y = F.linear(act, w(fc2.weight))
        m = tp.reduce_from(y if self.lora is None else self.lora.add("down_proj", act, y))
        return x + (rms_norm(m, w(self.post_mlp_layernorm.weight), eps) if self.post_norms else m)


class MtpLayer(nn.Module):
    """One of the checkpoint's MTP layers under megatron-core's names (``mtp.layers.{k}``): held
    and synced with the model, frozen (the RL loss has no MTP term), never run here."""

    def __init__(self, model: TrainerModel, tensors: dict[str, torch.Tensor], prefix: str, layer: int) -> None:
        super().__init__()
        for norm in ("enorm", "hnorm"):
            setattr(self, norm, Weights(tensors, prefix + norm, ("weight",), tp_sharded=False))
        self.eh_proj = Weights(tensors, prefix + "eh_proj", ("weight",), tp_sharded=True)
        self.transformer_layer = Layer(model, tensors, prefix + "transformer_layer.", layer)
        self.final_layernorm = Weights(tensors, prefix + "final_layernorm", ("weight",), tp_sharded=False)
        self.requires_grad_(False)
