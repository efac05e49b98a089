"""Strided runs: a link's plan copies fused where offsets repeat with a constant row stride,
and the in-place tensor views that execute them (for one-sided transports, which read the
source tensors directly instead of packing buffers).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from shardsync.plan.plan import Copy


@dataclass(frozen=True)
class Run:
    """``n`` copies of one shape whose offsets advance by a constant step along dim 0."""

    first: Copy
    n: int
    src_step: int
    dst_step: int


def coalesce(copies: Sequence[Copy]) -> list[Run]:
    """Fuse copies between the same tensors that repeat with a constant row stride on both
    sides (a QKV shard is 3 runs, not 3 x groups copies): one kernel per run."""
    groups: dict[tuple, list[Copy]] = defaultdict(list)
    for c in copies:
        groups[(c.src, c.src_local, c.dst_local, c.sizes, c.src_offsets[1:], c.dst_offsets[1:])].append(c)
    runs: list[Run] = []
    for group in groups.values():
        group.sort(key=lambda c: c.dst_offsets[0])  # engines concatenate: runs follow the destination
        i = 0
        while i < len(group):
            j = i + 1
            if j < len(group):
                ss = group[j].src_offsets[0] - group[i].src_offsets[0]
                ds = group[j].dst_offsets[0] - group[i].dst_offsets[0]
                if ds >= group[i].sizes[0] and ss >= 0:  # as_strided takes no negative steps
                    while (j < len(group) and group[j].src_offsets[0] - group[j - 1].src_offsets[0] == ss
                           and group[j].dst_offsets[0] - group[j - 1].dst_offsets[0] == ds):
                        j += 1
            if j - i > 1:
                runs.append(Run(group[i], j - i, ss, ds))
            else:
                j = i + 1
                runs.append(Run(group[i], 1, 0, 0))
            i = j
    return runs


def _view(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], n: int, step: int) -> torch.Tensor:
    base = t.storage_offset() + sum(o * s for o, s in zip(offsets, t.stride(), strict=True))
    if n == 1:
        return t.as_strided(sizes, t.stride(), base)
    return t.as_strided((n, *sizes), (step * t.stride(0), *t.stride()), base)


def _wide(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes as 8-byte words when no dtype conversion happens: a strided copy of
    bf16 rows moves 4x fewer elements (the elementwise copy kernel is per-element bound)."""
    if dst.dtype != src.dtype or dst.element_size() >= 8:
        return dst, src
    try:
        return dst.view(torch.int64), src.view(torch.int64)
    except RuntimeError:  # a row or an offset not a multiple of 8 bytes: keep the dtype
        return dst, src


def compile_runs(runs: Sequence[Run], src: Mapping[str, torch.Tensor],
                 dst: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) pairs; built once per mapping, reused every update."""
    return [_wide(_view(dst[r.first.dst_local], r.first.dst_offsets, r.first.sizes, r.n, r.dst_step),
                  _view(src[r.first.src_local], r.first.src_offsets, r.first.sizes, r.n, r.src_step))
            for r in runs]


SMALL_BYTES = 1 << 20
SIDE_STREAMS = 3


@dataclass
class Bounce:
    """Strided reads from host memory (offloaded weights): one contiguous host span per
    source storage goes to the device in one DMA, then the strided views are device copies
    out of it.  A strided copy straight from host memory would first gather it into a
    pageable temporary on the CPU (a fifth of the link's speed, measured on the H200)."""

    span: torch.Tensor  # contiguous host view covering every source view of the group
    views: list[tuple[torch.Tensor, tuple, tuple, int]]  # (dst, size, stride, offset into span)

    @classmethod
    def groups(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[Bounce]:
        by: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        for d, src in pairs:
            by[(src.untyped_storage().data_ptr(), src.dtype)].append((d, src))
        out = []
        for group in by.values():
            lo = min(src.storage_offset() for _, src in group)
            hi = max(src.storage_offset() + sum((n - 1) * st for n, st in zip(src.shape, src.stride(), strict=True)) + 1
                     for _, src in group)
            base = group[0][1]
            span = torch.empty(0, dtype=base.dtype).set_(base.untyped_storage(), lo, (hi - lo,))
            out.append(cls(span, [(d, tuple(src.shape), tuple(src.stride()), src.storage_offset() - lo)
                                  for d, src in group]))
        return out

    def run(self, buffer: torch.Tensor) -> None:
        n = self.span.numel()
        flat = buffer.view(self.span.dtype)[:n]
        flat.copy_(self.span, non_blocking=True)
        for d, size, stride, offset in self.views:
            d.copy_(flat.as_strided(size, stride, offset))

    @property
    def nbytes(self) -> int:
        return self.span.numel() * self.span.element_size()


@dataclass
class Copies:
    """Compiled (destination, source) view pairs, split once: small contiguous ones go in one
    multi-tensor launch on CUDA; strided reads of host memory go through a device bounce
    buffer (``Bounce``, at most the largest source tensor); the rest are dealt round-robin
    over the current stream and side streams so one copy's tail overlaps the next one's start
    (Qwen3-4B on an H200, ``benchmarks/gpu_update.py``: 1601 -> 1749 GB/s with 3 side streams)."""

    small: tuple[list[torch.Tensor], list[torch.Tensor]]
    rest: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device | None = None  # where the copies run (None: no copies)
    bounced: list[Bounce] | None = None
    _buffer: torch.Tensor | None = None
    gather: object | None = None  # transport.gather.Gather: every copy in one launch
    on_device: bool = True  # every copy reads and writes device memory: complete in stream order

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, gather: bool = True) -> Copies:
        """``gather``: device-to-device copies of one dtype go as one Triton launch where
        Triton is installed (``transport.gather``)."""
        on_device = all(d.is_cuda and s.is_cuda for d, s in pairs)
        if gather and pairs and on_device and all(d.dtype == s.dtype for d, s in pairs):
            from shardsync.transport import gather as tiles

            if tiles.available():
                return cls(([], []), [], pairs[0][0].device, gather=tiles.Gather(pairs))
        small = [(d, s) for d, s in pairs if d.is_cuda and d.numel() * d.element_size() < SMALL_BYTES
                 and d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.device == s.device]
        if len(small) < 2:
            small = []
        done = {id(d) for d, _ in small}
        strided = [(d, s) for d, s in pairs if d.is_cuda and not s.is_cuda and not s.is_contiguous()]
        done |= {id(d) for d, _ in strided}
        return cls(([d for d, _ in small], [s for _, s in small]),
                   [(d, s) for d, s in pairs if id(d) not in done], pairs[0][0].device if pairs else None,
                   Bounce.groups(strided), on_device=on_device)

    def run(self, streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Every copy, ordered after the current stream's earlier work and before its later work."""
        if self.gather is not None:
            self.gather.run()
            return
        if self.small[0]:
            torch._foreach_copy_(*self.small)
        if self.bounced:
            if self._buffer is None:
                size = -(-max(b.nbytes for b in self.bounced) // 8) * 8  # viewable as any dtype
                self._buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
            for b in self.bounced:  # one stream: a span's DMA waits for the previous span's reads
                b.run(self._buffer)
        rest = self.rest
        if not streams or not rest or not rest[0][0].is_cuda:
            for d, s in rest:
                d.copy_(s)
            return
        # from host memory (offloaded weights): asynchronous when it is page-locked, so the
        # streams overlap DMA; the caller synchronizes the current stream after ``run``
        from_host = not rest[0][1].is_cuda
        current = torch.cuda.current_stream(rest[0][0].device)
        k = len(streams) + 1
        for i, side in enumerate(streams, start=1):
            side.wait_stream(current)  # the weights are not read (e.g. by a forward) any more
            with torch.cuda.stream(side):
                for d, s in rest[i::k]:
                    d.copy_(s, non_blocking=from_host)
        for d, s in rest[0::k]:
            d.copy_(s, non_blocking=from_host)
        for side in streams:
            current.wait_stream(side)  # a synchronize of the current stream covers every copy
