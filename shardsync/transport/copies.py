"""Compiled (destination, source) view pairs executed on the device: small contiguous copies in
one multi-tensor launch, strided host reads through a device bounce buffer, the rest dealt
over side streams, or every copy as one Triton gather (``transport.gather``).  It is the
colocated paths' copy execution, kept out of the pure plan room (``plan.runs`` compiles the
views it runs).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shardsync.transport import gather as tiles

SMALL_BYTES = 1 << 20
SIDE_STREAMS = 3


@dataclass
class Bounce:
    """Strided reads from host memory (offloaded weights): one contiguous host span per
    source storage goes to the device in one DMA, then the strided views are device copies
    out of it.  A strided copy straight from host memory would first gather it into a
    pageable temporary on the CPU (a fifth of the link's speed, measured on the H200)."""

    span: torch.Tensor  # contiguous host view covering every source view of the group
    views: list[tuple[torch.Tensor, tuple, tuple, int | torch.SymInt]]  # (dst, size, stride, offset into span)

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
            span = torch.empty(0, dtype=base.dtype).set_(base.untyped_storage(), lo, (hi - lo,), (1,))
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
    gather: tiles.Gather | None = None  # every copy in one launch
    on_device: bool = True  # every copy reads and writes device memory: complete in stream order

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], *, gather: bool = True) -> Copies:
        """``gather``: device-to-device copies of one dtype go as one Triton launch where
        Triton is installed (``transport.gather``)."""
        on_device = all(d.is_cuda and s.is_cuda for d, s in pairs)
        if gather and pairs and on_device and all(d.dtype == s.dtype for d, s in pairs):
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


class SideStreams:
    """The side streams ``Copies.run`` deals copies over, made once on the first CUDA device
    asked for (host copies get none)."""

    def __init__(self) -> None:
        self._streams: list[torch.cuda.Stream] = []

    def of(self, device: torch.device | None) -> list[torch.cuda.Stream]:
        if device is None or device.type != "cuda":
            return []
        if not self._streams:
            self._streams = [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)]
        return self._streams
