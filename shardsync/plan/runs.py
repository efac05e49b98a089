"""Strided runs: a link's plan copies fused where offsets repeat with a constant row stride,
and the in-place tensor views they compile into (for one-sided transports, which read the
source tensors directly instead of packing buffers).  Pure: building views moves no bytes;
``transport.copies`` executes them.
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


def box_view(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], n: int = 1,
             step: int = 0) -> torch.Tensor:
    """The box of ``t`` at ``offsets`` (``n`` of them, ``step`` rows apart): a view, no copy."""
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
    return [_wide(box_view(dst[r.first.dst_local], r.first.dst_offsets, r.first.sizes, r.n, r.dst_step),
                  box_view(src[r.first.src_local], r.first.src_offsets, r.first.sizes, r.n, r.src_step))
            for r in runs]
