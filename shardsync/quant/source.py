"""A trainer rank's half of FP8 on the wire: before each send it quantizes its region of every
weight sent quantized (``quant.wire.Derived``) into the local tensors the plans read.

A region held in one piece is quantized from the parameter in place; one held in several
pieces (Megatron's fused QKV interleaves each query group's rows) is assembled first, into a
buffer kept across updates.  On a GPU the block formats run as one fused pass per region
(``quant.kernel``), all of them replayed as one CUDA graph: hundreds of launches from Python
would take longer than the quantization itself.  The e4m3 bytes are kept as int32 words, the
layout's dtype for them.  Memory: half the rank's quantized weights, plus their scales.
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
    paths read; ``refresh`` re-derives them from the parameters' current values.  ``count``:
    also count the e4m3 bytes and scales that change (on a GPU a quarter more bytes read)."""

    def __init__(self, derived: Sequence[Derived], params: Mapping[str, torch.Tensor], fmt: Fp8Format,
                 *, count: bool = True) -> None:
        self.derived, self.params, self.fmt, self.count = tuple(derived), params, fmt, count
        own: dict[str, torch.Tensor] = {}
        self._assembled: dict[str, torch.Tensor] = {}
        for d in self.derived:
            like = params[d.parts[0].local]
            q, s = quantize(torch.zeros(d.sizes, dtype=like.dtype, device=like.device), fmt)
            own[d.words] = q.view(torch.int32).clone()
            own[d.scales] = s.clone()
            if len(d.parts) > 1:
                self._assembled[d.words] = torch.empty(d.sizes, dtype=like.dtype, device=like.device)
        self.tensors: dict[str, torch.Tensor] = {**params, **own}
        device = next(iter(own.values())).device if own else torch.device("cpu")
        self._changed = torch.zeros((), dtype=torch.int64, device=device)  # the torch path's count
        self._counted = torch.zeros(1, dtype=torch.int64, device=device)  # the fused kernel's
        on_gpu = [fused(fmt, self.region(d)) for d in self.derived]
        self._fused = [d for d, f in zip(self.derived, on_gpu, strict=True) if f]
        self._rest = [d for d, f in zip(self.derived, on_gpu, strict=True) if not f]
        self._graph: tuple[tuple[int, ...], torch.cuda.CUDAGraph] | None = None

    def region(self, d: Derived) -> torch.Tensor:
        """``d``'s region of the parameters: a view of one piece, or its pieces assembled."""
        if len(d.parts) == 1:
            p = d.parts[0]
            return self.params[p.local][_region(p.local_offsets, p.sizes)]
        out = self._assembled[d.words]
        for p in d.parts:
            out[_region(_rel(p, d), p.sizes)] = self.params[p.local][_region(p.local_offsets, p.sizes)]
        return out

    def _fused_pass(self) -> None:
        for d in self._fused:
            quantize_into(self.region(d), self.tensors[d.words], self.tensors[d.scales], self.fmt,
                          self._counted if self.count else None)

    def _replay(self) -> None:
        """The fused pass as one graph; where a parameter moved (or the first time) this update
        runs it eagerly (which compiles the kernels) and captures it for the next."""
        where = tuple(self.params[p.local].data_ptr() for d in self._fused for p in d.parts)
        if self._graph is not None and self._graph[0] == where:
            self._graph[1].replay()
            return
        self._fused_pass()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self._fused_pass()  # recorded, not run
        self._graph = (where, graph)

    @torch.no_grad()
    def refresh(self) -> tuple[float, int]:
        """Quantize every region from the parameters now: the seconds it took, and (``count``)
        how many e4m3 bytes and scales changed (what a delta of the FP8 weights would move)."""
        t0 = time.perf_counter()
        self._changed.zero_()
        self._counted.zero_()
        if self._fused:
            self._replay()
        for d in self._rest:
            region = self.region(d)
            q, s = quantize(region, self.fmt)
            words, scales = self.tensors[d.words], self.tensors[d.scales]
            if self.count:
                self._changed += (words.view(torch.uint8).view(q.shape) != q.view(torch.uint8)).sum()
                self._changed += (scales != s).sum()
            words.copy_(q.view(torch.int32))
            scales.copy_(s)
        if self._changed.is_cuda:
            torch.cuda.current_stream(self._changed.device).synchronize()  # the phase ends when the bytes are there
        return time.perf_counter() - t0, int(self._changed) + int(self._counted)


def _rel(p: Piece, d: Derived) -> tuple[int, ...]:
    return tuple(o - b for o, b in zip(p.offsets, d.offsets, strict=True))
