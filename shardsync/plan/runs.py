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
class Copies:
    """Compiled (destination, source) view pairs, split once: small contiguous ones go in one
    multi-tensor launch on CUDA; the rest are dealt round-robin over the current stream and
    side streams so one copy's tail overlaps the next one's start (Qwen3-4B on an H200,
    ``benchmarks/gpu_update.py``: 1601 -> 1749 GB/s with 3 side streams)."""

    small: tuple[list[torch.Tensor], list[torch.Tensor]]
    rest: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device | None = None  # where the copies run (None: no copies)

    @classmethod
    def of(cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Copies:
        small = [(d, s) for d, s in pairs if d.is_cuda and d.numel() * d.element_size() < SMALL_BYTES
                 and d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.device == s.device]
        if len(small) < 2:
            small = []
        done = {id(d) for d, _ in small}
        return cls(([d for d, _ in small], [s for _, s in small]),
                   [(d, s) for d, s in pairs if id(d) not in done], pairs[0][0].device if pairs else None)

    def run(self, streams: Sequence[torch.cuda.Stream] = ()) -> None:
        """Every copy, ordered after the current stream's earlier work and before its later work."""
        if self.small[0]:
            torch._foreach_copy_(*self.small)
        rest = self.rest
        if not streams or not rest or not rest[0][0].is_cuda:
            for d, s in rest:
                d.copy_(s)
            return
        current = torch.cuda.current_stream(rest[0][0].device)
        k = len(streams) + 1
        for i, side in enumerate(streams, start=1):
            side.wait_stream(current)  # the weights are not read (e.g. by a forward) any more
            with torch.cuda.stream(side):
                for d, s in rest[i::k]:
                    d.copy_(s)
        for d, s in rest[0::k]:
            d.copy_(s)
        for side in streams:
            current.wait_stream(side)  # a synchronize of the current stream covers every copy
