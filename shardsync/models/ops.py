"""Numerics shared by the reference engine and trainer, written to match ``transformers``.

Kept in one place so that engine and trainer differ only in layout, never in math.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from shardsync.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """HF LlamaRMSNorm/Qwen*RMSNorm: normalize in fp32, cast back, then scale.  ``offset``: a
    zero-centred norm (Qwen3-Next, Gemma) scales by ``offset + weight`` in fp32, then casts."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(dtype)
    return weight * h.to(dtype)


def _yarn(spec: ModelSpec, freqs: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by ``factor``, keep the high ones, blend linearly
    between the dims whose wavelengths fit ``beta_fast`` and ``beta_slow`` turns in the original
    context (DeepSeek-V3, Kimi-K2)."""
    rs, d, base = spec.rope_scaling or {}, spec.rotary_dim, spec.rope_theta
    factor = rs["factor"]
    original = rs.get("original_max_position_embeddings") or spec.max_position_embeddings

    def dim_of(turns: float) -> float:
        return d * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(dim_of(rs.get("beta_fast") or 32.0)), 0)
    high = min(math.ceil(dim_of(rs.get("beta_slow") or 1.0)), d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    return freqs / factor * (1 - keep) + freqs * keep


def rope_attention_factor(spec: ModelSpec) -> float:
    """YaRN's cos/sin multiplier: mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    rs = spec.rope_scaling or {}
    if rs.get("rope_type") != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])

    def mscale(m: float) -> float:
        return 1.0 if rs["factor"] <= 1 else 0.1 * m * math.log(rs["factor"]) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
    return mscale(1.0)


def inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 or YaRN frequency scaling when the spec asks."""
    d = spec.rotary_dim
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = spec.rope_scaling
    if not rs or rs.get("rope_type", rs.get("type")) in (None, "default"):
        return freqs
    if rs.get("rope_type") == "yarn":
        return _yarn(spec, freqs)
    if rs.get("rope_type", rs.get("type")) != "llama3":
        raise ValueError(f"rope_scaling {rs} not supported (llama3 or yarn)")
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(spec: ModelSpec, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [..., seq, rotary_dim] for integer ``positions`` [..., seq]: each angle
    twice, as two halves (Llama/Qwen) or as neighbours (GLM4's interleaved rotary)."""
    f = inv_freq(spec).to(positions.device)
    angles = positions.float()[..., None] * f
    if spec.rope_interleaved:
        emb = angles.repeat_interleave(2, dim=-1)
    else:
        emb = torch.cat((angles, angles), dim=-1)
    factor = rope_attention_factor(spec)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """``x`` [batch, heads, seq, d]; cos/sin [batch, seq, rotary_dim]: the first rotary_dim
    channels rotate (partial rotary when rotary_dim < d), the rest pass through."""
    rotate = _rotate_pairs if interleaved else _rotate_half
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos[:, None] + rotate(x) * sin[:, None]
    head, rest = x[..., :r], x[..., r:]
    return torch.cat((head * cos[:, None] + rotate(head) * sin[:, None], rest), dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_offset: int | None = 0,
              mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """GQA attention: q [b, hq, s, d], k [b, hkv, t, d], v [b, hkv, t, dv] -> [b, hq, s, dv].

    ``causal_offset`` is the position of q's first row in k (KV-cache decode); None = no mask.
    ``scale``: the softmax scale (default 1/sqrt(d)).
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores * scale if scale is not None else scores / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        s, t = q.shape[-2], k.shape[-2]
        rows = torch.arange(s, device=q.device)[:, None] + causal_offset
        cols = torch.arange(t, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def router_logits(spec: ModelSpec, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[tokens, experts]`` router logits: in the activations' dtype (Qwen3-MoE) or in fp32
    (GLM4-MoE's sigmoid router keeps its weight and logits in fp32)."""
    if spec.router == "sigmoid":
        return F.linear(x.float(), weight.float())
    return F.linear(x, weight)


def route(spec: ModelSpec, logits: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, both ``[tokens, k]``.

    softmax (Qwen3-MoE): softmax in fp32 over every expert, top-k, optionally renormalized,
    weights in the logits' dtype.  sigmoid (GLM4-MoE): sigmoid scores; the choice adds the
    correction ``bias`` and is limited to the ``topk_group`` best of ``n_group`` expert groups
    (a group scores its two best); weights are the chosen scores, optionally renormalized, times
    ``routed_scaling_factor``.
    """
    k = spec.num_experts_per_tok
    if spec.router == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, k, dim=-1)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), chosen
    scores = logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if spec.n_group > 1:
        grouped = choice.view(-1, spec.n_group, spec.num_experts // spec.n_group)
        best = torch.topk(grouped.topk(2, dim=-1)[0].sum(dim=-1), spec.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(grouped[..., 0]).scatter_(1, best, 1.0).bool()
        choice = choice.masked_fill(~keep[..., None].expand_as(grouped).reshape(choice.shape), float("-inf"))
    chosen = torch.topk(choice, k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, chosen)
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * spec.routed_scaling_factor, chosen
