"""A trainer rank's half of FP8 on the wire: before each send it quantizes its region of every
weight sent quantized (``quant.wire.Derived``) into the local tensors the plans read.

A region held in one piece is quantized from the parameter in place; one held in several
pieces (Megatron's fused QKV interleaves each query group's rows) is read in place too where
each piece is whole blocks (the kernel takes each block row's source row), else assembled
first, into a buffer kept across updates.  On a GPU the block formats run as one fused pass
per region (``runtime.fp8_kernel``), all of them replayed as one CUDA graph: hundreds of launches
from Python would take longer than the quantization itself.  A push may take regions over
(``produce_into``): the pass writes them straight into the engine's staging.  The e4m3 bytes
are kept as int32 words, the layout's dtype for them.  Memory: half the rank's quantized
weights, plus their scales.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import torch

from shardsync.piece import Piece
from shardsync.plan.local import region as _region
from shardsync.plan.runs import Run, box_view
from shardsync.quant.fp8 import Fp8Format, quantize
from shardsync.quant.wire import PER_WORD, Derived
from shardsync.runtime.fp8_kernel import fused, quantize_into

# one fused quantize: the bf16 source, its block rows' source rows (or None), e4m3 and scales out
Job = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]


class SourceQuantizer:
    """``tensors``: the rank's parameters and its derived words and scales, one mapping the
    paths read; ``refresh`` re-derives them from the parameters' current values.  ``count``:
    also count the e4m3 bytes and scales that change (on a GPU a quarter more bytes read)."""

    def __init__(self, derived: Sequence[Derived], params: Mapping[str, torch.Tensor], fmt: Fp8Format,
                 *, count: bool = True) -> None:
        self.derived, self.params, self.fmt, self.count = tuple(derived), params, fmt, count
        own: dict[str, torch.Tensor] = {}
        self._assembled: dict[str, torch.Tensor] = {}
        self._rows: dict[str, torch.Tensor] = {}  # regions read in place from several pieces: source rows
        for d in self.derived:
            like = params[d.parts[0].local]
            q, s = quantize(torch.zeros(d.sizes, dtype=like.dtype, device=like.device), fmt)
            own[d.words] = q.view(torch.int32).clone()
            own[d.scales] = s.clone()
            rows = _block_rows(d, fmt) if len(d.parts) > 1 and like.is_cuda else None
            if rows is not None:
                self._rows[d.words] = torch.tensor(rows, dtype=torch.int32, device=like.device)
            elif len(d.parts) > 1:
                self._assembled[d.words] = torch.empty(d.sizes, dtype=like.dtype, device=like.device)
        self.tensors: dict[str, torch.Tensor] = {**params, **own}
        device = next(iter(own.values())).device if own else torch.device("cpu")
        self._changed = torch.zeros((), dtype=torch.int64, device=device)  # the torch path's count
        self._counted = torch.zeros(1, dtype=torch.int64, device=device)  # the fused kernel's
        on_gpu = [fused(fmt, self._source(d)[0]) for d in self.derived]
        self._fused = [d for d, f in zip(self.derived, on_gpu, strict=True) if f]
        self._rest = [d for d, f in zip(self.derived, on_gpu, strict=True) if not f]
        self._graph: _GraphOnce | None = None  # the fused pass, replayed
        self._pushed: set[str] = set()  # regions a push quantizes into the engine's staging (``produce_into``)

    def region(self, d: Derived) -> torch.Tensor:
        """``d``'s region of the parameters: a view of one piece, or its pieces assembled."""
        if len(d.parts) == 1:
            p = d.parts[0]
            return self.params[p.local][_region(p.local_offsets, p.sizes)]
        out = self._assembled[d.words] if d.words in self._assembled else torch.empty(
            d.sizes, dtype=self.params[d.parts[0].local].dtype, device=self.params[d.parts[0].local].device)
        for p in d.parts:
            out[_region(_rel(p, d), p.sizes)] = self.params[p.local][_region(p.local_offsets, p.sizes)]
        return out

    def _source(self, d: Derived) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the fused kernel reads for ``d``: its region, or (pieces read in place) the
        parameter's columns and each block row's source row."""
        rows = self._rows.get(d.words)
        if rows is None:
            return self.region(d), None
        p = d.parts[0]
        return self.params[p.local][:, p.local_offsets[1]:p.local_offsets[1] + p.sizes[1]], rows

    @property
    def pushed(self) -> frozenset[str]:
        """The words of the regions a push quantizes straight into the engine's staging."""
        return frozenset(self._pushed)

    def produce_into(self, runs: Sequence[Run], dst: Mapping[str, torch.Tensor]) -> tuple[Callable[[], None] | None,
                                                                                          list[Run]]:
        """A push's producer (``transport.colocated.push_sender.Producer``): the e4m3 words and
        scales of regions the fused kernel reads in place are quantized on the GPU straight
        from the parameters into ``dst`` (the engine's staging set), one pass for the pair of
        runs that would copy them; those regions are no longer quantized here before a send."""
        mine = {d.words: d for d in self._fused if len(d.parts) == 1 or d.words in self._rows}
        scales = {(r.first.src_local, r.first.src_offsets): r for r in runs if r.n == 1}
        bm, bn = self.fmt.block or (1, 1)
        jobs: list[Job] = []
        used: set[int] = set()
        for r in runs:
            d = mine.get(r.first.src_local)
            if d is None or r.n != 1:
                continue
            (r0, w0), (nr, nw) = r.first.src_offsets, r.first.sizes
            c0, nc = w0 * PER_WORD, nw * PER_WORD
            s = scales.get((d.scales, (r0 // bm, c0 // bn)))
            aligned = r0 % bm == 0 and c0 % bn == 0 and (nr % bm == 0 or r0 + nr == d.sizes[0]) and \
                (nc % bn == 0 or c0 + nc == d.sizes[1])
            if not aligned or s is None or s.first.sizes != (-(-nr // bm), -(-nc // bn)):
                continue
            w, rows = self._source(d)
            if dst[r.first.dst_local].device != w.device:  # another GPU's staging: the copies cross devices
                continue
            w = w[:, c0:c0 + nc] if rows is not None else w[r0:r0 + nr, c0:c0 + nc]
            q = box_view(dst[r.first.dst_local], r.first.dst_offsets, r.first.sizes).view(torch.float8_e4m3fn)
            jobs.append((w, None if rows is None else rows[r0 // bm:], q,
                         box_view(dst[s.first.dst_local], s.first.dst_offsets, s.first.sizes)))
            used |= {id(r), id(s)}
            self._pushed.add(d.words)
        if not jobs:
            return None, list(runs)
        self._graph = None  # the pass before a send leaves the pushed regions out from now on
        fmt = self.fmt

        def quantize_all() -> None:
            for w, rows, q, s in jobs:
                quantize_into(w, q, s, fmt, rows=rows)

        return _GraphOnce(quantize_all), [r for r in runs if id(r) not in used]

    def _fused_pass(self, every: bool = False) -> None:
        for d in self._fused:
            if d.words in self._pushed and not every:
                continue
            w, rows = self._source(d)
            quantize_into(w, self.tensors[d.words], self.tensors[d.scales], self.fmt,
                          self._counted if self.count else None, rows=rows)

    def _where(self) -> tuple[int, ...]:
        """The parameters' addresses the fused pass reads: a moved parameter needs a new graph."""
        return tuple(self.params[p.local].data_ptr() for d in self._fused for p in d.parts)

    @torch.no_grad()
    def refresh(self, *, every: bool = False) -> tuple[float, int]:
        """Quantize every region from the parameters now (but those a push writes itself, unless
        ``every``: checksums read them here): the seconds it took, and (``count``) how many e4m3
        bytes and scales changed (what a delta of the FP8 weights would move)."""
        t0 = time.perf_counter()
        self._changed.zero_()
        self._counted.zero_()
        if every and self._pushed:
            self._fused_pass(every=True)
        elif len(self._fused) > len(self._pushed):
            if self._graph is None:
                self._graph = _GraphOnce(self._fused_pass, self._where)
            self._graph()
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


def _block_rows(d: Derived, fmt: Fp8Format) -> list[int] | None:
    """The source row of each block row of ``d``'s region when its pieces are rows of one
    parameter, the same columns, each whole blocks (Megatron's fused QKV groups of 128-row
    heads); None when a block would mix pieces (the region is assembled)."""
    if fmt.block is None or len(d.sizes) != 2:
        return None
    bm = fmt.block[0]
    first = d.parts[0]
    if any(p.local != first.local or p.local_offsets[1:] != first.local_offsets[1:] or p.sizes[1:] != d.sizes[1:]
           for p in d.parts):
        return None
    starts: list[int | None] = [None] * -(-d.sizes[0] // bm)
    for p in d.parts:
        r = _rel(p, d)[0]
        if r % bm or (p.sizes[0] % bm and r + p.sizes[0] != d.sizes[0]):
            return None
        for i in range(r // bm, -(-(r + p.sizes[0]) // bm)):
            starts[i] = p.local_offsets[0] + i * bm - r
    return None if any(s is None for s in starts) else [s for s in starts if s is not None]


class _GraphOnce:
    """Runs ``fn`` (kernel launches on the current stream) eagerly the first time, which
    compiles them, captures it as a CUDA graph, and replays the graph from then on; ``key``
    (the addresses ``fn`` reads): where it changes, ``fn`` runs and is captured again."""

    def __init__(self, fn: Callable[[], None], key: Callable[[], tuple[int, ...]] = tuple) -> None:
        self.fn, self.key = fn, key
        self.graph: tuple[tuple[int, ...], torch.cuda.CUDAGraph] | None = None

    def __call__(self) -> None:
        at = self.key()
        if self.graph is not None and self.graph[0] == at:
            self.graph[1].replay()
            return
        self.fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            self.fn()  # recorded, not run
        self.graph = (at, graph)
