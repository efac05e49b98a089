"""A trainer rank's half of FP8 on the wire: before each send it quantizes its region of every
weight sent quantized (``quant.wire.Derived``) into the local tensors the plans read.

A region held in one piece is quantized from the parameter in place; one held in several
pieces (Megatron's fused QKV interleaves each query group's rows) is assembled first.  On a
GPU the block formats run as one fused pass (``quant.kernel``).  The
e4m3 bytes are kept as int32 words, the layout's dtype for them.  Memory: half the rank's
quantized weights, plus their scales.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from shardsync.layout.piece import Piece
from shardsync.plan.local import region as _region
from shardsync.quant.fp8 import Fp8Format, quantize
from shardsync.quant.kernel import fused, quantize_into
from shardsync.quant.wire import Derived


class SourceQuantizer:
    """``tensors``: the rank's parameters and its derived words and scales, one mapping the
    paths read; ``refresh`` re-derives them from the parameters' current values."""

    def __init__(self, derived: Sequence[Derived], params: Mapping[str, torch.Tensor], fmt: Fp8Format) -> None:
        self.derived, self.params, self.fmt = tuple(derived), params, fmt
        own: dict[str, torch.Tensor] = {}
        for d in self.derived:
            like = params[d.parts[0].local]
            q, s = quantize(torch.zeros(d.sizes, dtype=like.dtype, device=like.device), fmt)
            own[d.words] = q.view(torch.int32).clone()
            own[d.scales] = s.clone()
        self.tensors: dict[str, torch.Tensor] = {**params, **own}
        device = next(iter(own.values())).device if own else torch.device("cpu")
        # changed bytes: the torch path's and the fused kernel's, kept across updates
        self._counts = (torch.zeros((), dtype=torch.int64, device=device),
                        torch.zeros(1, dtype=torch.int32, device=device))

    def region(self, d: Derived) -> torch.Tensor:
        """``d``'s region of the parameters: a view of one piece, or its pieces assembled."""
        if len(d.parts) == 1:
            p = d.parts[0]
            return self.params[p.local][_region(p.local_offsets, p.sizes)]
        like = self.params[d.parts[0].local]
        out = torch.empty(d.sizes, dtype=like.dtype, device=like.device)
        for p in d.parts:
            out[_region(_rel(p, d), p.sizes)] = self.params[p.local][_region(p.local_offsets, p.sizes)]
        return out

    @torch.no_grad()
    def refresh(self) -> tuple[float, int]:
        """Quantize every region from the parameters now: the seconds it took, and how many
        e4m3 bytes and scales changed (what a delta of the FP8 weights would move)."""
        t0 = time.perf_counter()
        changed, counted = self._counts
        changed.zero_()
        counted.zero_()
        for d in self.derived:
            region = self.region(d)
            if fused(self.fmt, region):  # one GPU pass, straight into the kept words and scales
                quantize_into(region, self.tensors[d.words], self.tensors[d.scales], self.fmt, counted)
                continue
            q, s = quantize(region, self.fmt)
            words, scales = self.tensors[d.words], self.tensors[d.scales]
            changed += (words.view(torch.uint8).view(q.shape) != q.view(torch.uint8)).sum()
            changed += (scales != s).sum()
            words.copy_(q.view(torch.int32))
            scales.copy_(s)
        n = int(changed) + int(counted)  # waits for the device
        return time.perf_counter() - t0, n


def _rel(p: Piece, d: Derived) -> tuple[int, ...]:
    return tuple(o - b for o, b in zip(p.offsets, d.offsets, strict=True))
