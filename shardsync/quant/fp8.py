"""FP8 (e4m3) weights as engines quantize them: DeepGEMM's block cast, which SGLang's and vLLM's
``per_block_cast_to_fp8`` both copy, reproduced bit for bit.

Per block of ``bm x bn`` elements (a stacked weight ``[E, N, K]``: per expert): ``amax`` in
float32, floored at 1e-4; scale ``s = amax / 448`` (``ue8m0``: rounded up to a power of two, as
DeepGEMM's GEMMs require); ``q = e4m3(x * (1 / s))``; the engine stores ``s`` as
``weight_scale_inv`` (``w ~= q * s``).  Per channel is the same with one block per output row.
A shard of whole blocks quantizes to the slice of the whole tensor's result: the reason a
receiver or a sender may quantize its own shard and still equal the engine's quantizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
AMAX_FLOOR = 1e-4  # DeepGEMM's clamp: an all-zero block gets a finite scale


@dataclass(frozen=True)
class Fp8Format:
    """How an engine holds an FP8 weight.  ``block``: rows x columns sharing one scale (None:
    one scale per output row, per-channel FP8); ``scale``: ``float32`` (amax / 448) or
    ``ue8m0`` (that rounded up to a power of two, by its exponent bits: DeepGEMM's and SGLang's)
    or ``ue8m0-log2`` (vLLM's ``2 ** ceil(log2 s)``, which rounds a scale just above a power of
    two down to it: 2 in 10^7 random scales differ from ``ue8m0``)."""

    block: tuple[int, int] | None = (128, 128)
    scale: Literal["float32", "ue8m0", "ue8m0-log2"] = "float32"

    @property
    def name(self) -> str:
        kind = "channel" if self.block is None else f"block{self.block[0]}x{self.block[1]}"
        return f"fp8-{kind}" + ("" if self.scale == "float32" else f"-{self.scale}")

    @property
    def scale_suffix(self) -> str:
        """Appended to a weight's name for its scale's (``x.weight`` -> ``x.weight_scale_inv``;
        ``experts.w13_weight`` -> ``experts.w13_weight_scale_inv``): SGLang's and vLLM's names."""
        return "_scale_inv" if self.block is not None else "_scale"

    def blocks(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Rows and columns of one block for a weight of ``shape`` (``[..., N, K]``)."""
        return (1, shape[-1]) if self.block is None else self.block

    def whole_blocks(self, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
        """Whether the box ``offsets/sizes`` of a ``shape`` matrix is whole blocks (a partial
        block only where the matrix ends): then its quantization is the slice of the matrix's."""
        if len(shape) != 2:
            return False
        return all(not (o % b or (s % b and o + s != n))
                   for o, s, n, b in zip(offsets, sizes, shape, self.blocks(shape), strict=True))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale tensor's shape for a weight of ``shape``: ``[..., ceil(N/bm), ceil(K/bn)]``."""
        if len(shape) < 2:
            raise ValueError(f"FP8 weights are matrices or stacks of them; got shape {shape}")
        bm, bn = self.blocks(shape)
        return (*shape[:-2], math.ceil(shape[-2] / bm), math.ceil(shape[-1] / bn))


FORMATS: dict[str, Fp8Format] = {f.name: f for f in (
    Fp8Format(), Fp8Format(scale="ue8m0"), Fp8Format(scale="ue8m0-log2"), Fp8Format(block=None))}
FORMATS["fp8"] = Fp8Format()  # DeepSeek-V3 / Qwen3 FP8 checkpoints: 128 x 128, float32 scales


def fp8_format(name: str) -> Fp8Format:
    """The format named ``name`` (``fp8``, ``fp8-block128x128-ue8m0``, ``fp8-channel``, ...)."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown FP8 format {name!r}; known: {sorted(FORMATS)}") from None


def ceil_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """The next power of two >= ``x`` (float32, positive), by its exponent bits: DeepGEMM's."""
    bits = x.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def _blocked(w: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, tuple[int, int]]:
    """``w`` as ``[G, N', K']`` zero-padded to whole blocks (float32 not forced: the engines
    multiply in the weight's own dtype promoted by the float32 scale)."""
    n, k = w.shape[-2:]
    bm, bn = fmt.blocks(tuple(w.shape))
    flat = w.reshape(-1, n, k)
    pn, pk = math.ceil(n / bm) * bm, math.ceil(k / bn) * bn
    if (pn, pk) != (n, k):
        padded = torch.zeros((flat.shape[0], pn, pk), dtype=w.dtype, device=w.device)
        padded[:, :n, :k] = flat
        flat = padded
    return flat, (bm, bn)


def quantize(w: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``w`` ([..., N, K], any float dtype) in e4m3 and its float32 scales
    (``fmt.scale_shape``), equal bit for bit to the engines' ``per_block_cast_to_fp8`` of it."""
    n, k = w.shape[-2:]
    flat, (bm, bn) = _blocked(w, fmt)
    g, pn, pk = flat.shape
    view = flat.view(g, pn // bm, bm, pk // bn, bn)
    amax = view.abs().float().amax(dim=(2, 4), keepdim=True).clamp(AMAX_FLOOR)
    s = amax / E4M3_MAX
    if fmt.scale == "ue8m0":
        s = ceil_ue8m0(s)
    elif fmt.scale == "ue8m0-log2":
        s = torch.pow(2.0, torch.ceil(torch.log2(s)))
    q = (view * (1.0 / s)).to(E4M3).view(g, pn, pk)[:, :n, :k]
    return (q.reshape(w.shape).contiguous(),
            s.reshape(*w.shape[:-2], pn // bm, pk // bn).contiguous())


def dequantize(q: torch.Tensor, s: torch.Tensor, fmt: Fp8Format, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * s`` per block, in ``dtype``: the weight an FP8 engine computes with."""
    n, k = q.shape[-2:]
    bm, bn = fmt.blocks(tuple(q.shape))
    wide = s.float().repeat_interleave(bm, dim=-2)[..., :n, :].repeat_interleave(bn, dim=-1)[..., :k]
    return (q.float() * wide).to(dtype)
