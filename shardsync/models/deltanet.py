"""Gated DeltaNet, the linear attention of Qwen3-Next and Qwen3.5, as one engine rank computes it
from its own tensors (the engine layout: whole key-head groups).  The math the reference models
will share for these families; written to match transformers' torch path (see
docs/notes/qwen3_next_sources.md, A.3): projections, a causal depthwise conv over ``[q | k | v]``
with SiLU, l2-normed q and k (q scaled by ``dk^-1/2``), ``beta = sigmoid(b)``, the log decay
``g = -exp(A_log) softplus(a + dt_bias)``, the delta rule per value head in float32
(``S <- e^g S + k (beta (v - (e^g S)^T k))^T``, ``o = S^T q``), a gated RMSNorm
(``norm(o) * silu(z)``) and ``out_proj`` (row-parallel: the caller sums the ranks' outputs).
Not yet wired into ``EngineModel`` / ``TrainerModel``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardsync.family.section import Linear
from shardsync.spec import ModelSpec


@dataclass
class DeltaState:
    """What a sequence carries from one step to the next: the conv's last ``K - 1`` inputs
    ``[b, channels, K - 1]`` and the recurrent state ``[b, value heads, dk, dv]`` (float32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass(frozen=True)
class DeltaWeights:
    """One rank's tensors of a linear-attention layer, as the engine layout holds them."""

    in_proj_qkvz: torch.Tensor
    in_proj_ba: torch.Tensor
    conv1d: torch.Tensor  # [channels, 1, K]
    dt_bias: torch.Tensor
    A_log: torch.Tensor
    norm: torch.Tensor
    out_proj: torch.Tensor


def split_projections(spec: ModelSpec, qkvz: torch.Tensor, ba: torch.Tensor, interleaved: bool
                      ) -> tuple[torch.Tensor, ...]:
    """``q, k [b, s, key heads, dk]``, ``v, z [b, s, value heads, dv]``, ``b, a [b, s, value heads]``
    of a rank's projections: per key-head group (Qwen3-Next's checkpoint order, kept by the
    engines) or as stacked blocks ``[q | k | v | z]``, ``[b | a]`` (Qwen3.5)."""
    lin = spec.section(Linear)
    dk, dv = lin.linear_key_head_dim, lin.linear_value_head_dim
    r = lin.linear_num_value_heads // lin.linear_num_key_heads
    bsz, s = qkvz.shape[:2]
    if interleaved:
        groups = qkvz.shape[-1] // (2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.view(bsz, s, groups, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(bsz, s, groups, 2 * r).split([r, r], dim=-1)
    else:
        groups = ba.shape[-1] // (2 * r)
        q, k, v, z = qkvz.split([groups * dk, groups * dk, groups * r * dv, groups * r * dv], dim=-1)
        b, a = ba.split([groups * r, groups * r], dim=-1)
    heads = groups * r
    return (q.reshape(bsz, s, groups, dk), k.reshape(bsz, s, groups, dk), v.reshape(bsz, s, heads, dv),
            z.reshape(bsz, s, heads, dv), b.reshape(bsz, s, heads), a.reshape(bsz, s, heads))


def causal_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of ``x [b, s, channels]`` with ``weight [channels, 1, K]``, then SiLU;
    ``state``: the previous ``K - 1`` inputs (zeros at the start).  Returns the output and the new state."""
    k = weight.shape[-1]
    xt = x.transpose(1, 2)
    prev = state if state is not None else xt.new_zeros(xt.shape[0], xt.shape[1], k - 1)
    full = torch.cat([prev.to(xt.dtype), xt], dim=-1)
    out = F.conv1d(full, weight.to(xt.dtype), groups=xt.shape[1])
    return F.silu(out).transpose(1, 2), full[..., full.shape[-1] - (k - 1):]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one step at a time, in float32: ``q, k [b, s, h, dk]``, ``v [b, s, h, dv]``,
    ``g, beta [b, s, h]``; returns ``o [b, s, h, dv]`` and the final state ``[b, h, dk, dv]``."""
    bsz, s, h, dk = k.shape
    dv = v.shape[-1]
    S = state if state is not None else q.new_zeros(bsz, h, dk, dv, dtype=torch.float32)
    outs = []
    for t in range(s):
        S = S * g[:, t].exp()[..., None, None]
        kt, vt = k[:, t], v[:, t]
        delta = (vt - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]
        S = S + kt[..., None] * delta[..., None, :]
        outs.append((S * q[:, t, :, :, None]).sum(-2))
    return torch.stack(outs, dim=1), S


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' gated RMSNorm: normalize in float32, cast back, scale, times silu(gate) in float32."""
    dtype = x.dtype
    h = x.float()
    h = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


def deltanet(spec: ModelSpec, x: torch.Tensor, w: DeltaWeights, *, interleaved: bool,
             state: DeltaState | None = None) -> tuple[torch.Tensor, DeltaState]:
    """One rank's linear attention of the normed input ``x [b, s, H]``: its ``out_proj`` partial
    (sum over the TP ranks) and the state to continue from."""
    q, k, v, z, b, a = split_projections(spec, F.linear(x, w.in_proj_qkvz), F.linear(x, w.in_proj_ba), interleaved)
    bsz, s = x.shape[:2]
    mixed = torch.cat([q.reshape(bsz, s, -1), k.reshape(bsz, s, -1), v.reshape(bsz, s, -1)], dim=-1)
    mixed, conv_state = causal_conv(mixed, w.conv1d, state.conv if state is not None else None)
    q, k, v = mixed.split([q[0, 0].numel(), k[0, 0].numel(), v[0, 0].numel()], dim=-1)
    lin = spec.section(Linear)
    heads, r = v.shape[-1] // lin.linear_value_head_dim, lin.linear_num_value_heads // lin.linear_num_key_heads
    q = q.reshape(bsz, s, -1, lin.linear_key_head_dim).repeat_interleave(r, dim=2)
    k = k.reshape(bsz, s, -1, lin.linear_key_head_dim).repeat_interleave(r, dim=2)
    v = v.reshape(bsz, s, heads, lin.linear_value_head_dim)
    beta = b.float().sigmoid()
    g = -w.A_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    q = l2norm(q.float()) * lin.linear_key_head_dim ** -0.5
    out, recurrent = delta_rule(q, l2norm(k.float()), v.float(), g, beta, state.recurrent if state else None)
    out = gated_rms_norm(out.to(x.dtype), w.norm, z, spec.rms_norm_eps)
    return F.linear(out.reshape(bsz, s, -1), w.out_proj), DeltaState(conv_state, recurrent)
