"""Transfer plans: the copy list that makes a destination layout equal a source layout.

Built once from metadata (names, shapes, dtypes, parallel configs).  A plan proves its
coverage: every destination piece is written exactly once, or ``build_plan`` raises
``PlanError`` naming the missing or doubled regions.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from shardsync.dtypes import torch_dtype
from shardsync.gcpause import gc_paused
from shardsync.layout.piece import Box, Layout, box_overlap, volume


class PlanError(ValueError):
    """A plan that cannot be built, with the regions that are missing or doubled."""


class Copy(NamedTuple):
    """Box ``sizes`` at ``src_offsets`` of (src, src_local) -> ``dst_offsets`` of (dst, dst_local).

    A named tuple, not a dataclass: a 235B plan holds ~10^5 of them and builds in a second."""

    src: int
    src_local: str
    src_offsets: Box
    dst: int
    dst_local: str
    dst_offsets: Box
    sizes: Box
    logical: str
    logical_offsets: Box

    @property
    def numel(self) -> int:
        return volume(self.sizes)


def dtype_itemsize(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


@dataclass(frozen=True)
class Plan:
    """Copies from ``src`` ranks to ``dst`` ranks; bytes count at the wire dtype."""

    src: Layout
    dst: Layout
    copies: tuple[Copy, ...]
    wire_dtype: str

    @cached_property
    def itemsize(self) -> int:
        return dtype_itemsize(self.wire_dtype)

    @cached_property
    def fingerprint(self) -> str:
        """Stable across processes and runs: both sides compare it before a byte moves."""
        h = hashlib.sha256()
        h.update(repr((self.src.describe(), self.dst.describe(), self.wire_dtype)).encode())
        for lay in (self.src, self.dst):
            for r in lay.ranks:
                h.update(repr([(t.name, t.shape, t.dtype) for t in r.tensors]).encode())
        for c in self.copies:
            h.update(repr((c.src, c.src_local, c.src_offsets, c.dst, c.dst_local,
                           c.dst_offsets, c.sizes)).encode())
        return h.hexdigest()[:16]

    @cached_property
    def link_bytes(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = defaultdict(int)
        for c in self.copies:
            out[(c.src, c.dst)] += c.numel * self.itemsize
        return dict(sorted(out.items()))

    @property
    def total_bytes(self) -> int:
        return sum(self.link_bytes.values())

    def busiest_link(self) -> tuple[tuple[int, int], int]:
        if not self.link_bytes:
            return (-1, -1), 0
        return max(self.link_bytes.items(), key=lambda kv: (kv[1], -kv[0][0], -kv[0][1]))

    def bytes_per_src(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (s, _), b in self.link_bytes.items():
            out[s] += b
        return dict(out)

    def bytes_per_dst(self) -> dict[int, int]:
        out: dict[int, int] = defaultdict(int)
        for (_, d), b in self.link_bytes.items():
            out[d] += b
        return dict(out)

    def copies_on(self, src: int, dst: int) -> list[Copy]:
        return [c for c in self.copies if c.src == src and c.dst == dst]

    def is_whole(self, c: Copy) -> tuple[bool, bool]:
        """Whether a copy spans its entire source / destination local tensor (no pack copy)."""
        s = self.src.ranks[c.src].tensor(c.src_local).shape
        d = self.dst.ranks[c.dst].tensor(c.dst_local).shape
        return (c.sizes == s and not any(c.src_offsets), c.sizes == d and not any(c.dst_offsets))


@gc_paused
def build_plan(src: Layout, dst: Layout, *, wire_dtype: str | None = None) -> Plan:
    """Intersect ``src`` with ``dst``; replicated source pieces go to the least-loaded holder."""
    if src.spec.name != dst.spec.name or src.logical != dst.logical:
        raise PlanError(f"layouts describe different models: {src.spec.name} vs {dst.spec.name}")
    # logical -> {(offsets, sizes): holders [(rank, local, local_offsets)]}
    index: dict[str, dict[tuple[Box, Box], list[tuple[int, str, Box]]]] = defaultdict(dict)
    for rank, rl in enumerate(src.ranks):
        for p in rl.pieces:
            index[p.logical].setdefault((p.offsets, p.sizes), []).append((rank, p.local, p.local_offsets))
    boxes = {k: list(v.items()) for k, v in index.items()}

    load = [0] * src.world_size
    problems: list[str] = []
    # (logical box, local offsets) -> [(numel, [(rank, local, src offsets)], dst offsets, overlap)]:
    # identical engines hit the cache, leaving only the holder choice per piece.
    cache: dict[tuple[str, Box, Box, Box], list] = {}
    disjoint: dict[str, bool] = {}
    copies: list[Copy] = []
    for dst_rank, rl in enumerate(dst.ranks):
        for p in rl.pieces:
            key = (p.logical, p.offsets, p.sizes, p.local_offsets)
            hits = cache.get(key)
            if hits is None:
                mine = boxes.get(p.logical, [])
                if p.logical not in disjoint:
                    disjoint[p.logical] = _disjoint(mine)
                hits = cache[key] = _hits(p.logical, p.offsets, p.sizes, p.local_offsets, mine,
                                          disjoint[p.logical], problems)
            for numel, srcs, dst_off, ov_off, ov_size in hits:
                if len(srcs) == 1:
                    rank, local, src_off = srcs[0]
                else:
                    rank, local, src_off = min(srcs, key=lambda h: (load[h[0]], h[0]))
                load[rank] += numel
                copies.append(Copy(rank, local, src_off, dst_rank, p.local, dst_off, ov_size,
                                   p.logical, ov_off))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanError(
            f"cannot plan {src.describe()} -> {dst.describe()}: destination regions not covered "
            f"exactly once:\n  {shown}{more}"
        )
    copies.sort(key=lambda c: (c.src, c.dst))  # stable: per link, destination order kept
    return Plan(src, dst, tuple(copies), wire_dtype or dst.ranks[0].tensors[0].dtype)


def _disjoint(boxes: list) -> bool:
    return all(box_overlap(*a[0], *b[0]) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _hits(logical: str, offsets: Box, sizes: Box, local_offsets: Box, boxes: list, disjoint: bool,
          problems: list[str]) -> list:
    """The source boxes one destination piece reads, as (numel, holders, dst offsets, box)."""
    if disjoint:  # a piece inside one of disjoint source boxes (TP shards, a whole tensor) reads it alone
        for (off, size), holders in boxes:
            if all(o <= q and q + n <= o + m for o, m, q, n in zip(off, size, offsets, sizes, strict=True)):
                rel = tuple(q - o for q, o in zip(offsets, off, strict=True))
                srcs = holders if not any(rel) else [
                    (rank, local, tuple(lo + r for lo, r in zip(loc, rel, strict=True)))
                    for rank, local, loc in holders]
                return [(volume(sizes), srcs, local_offsets, offsets, sizes)]
    raw = []
    for (off, size), holders in boxes:
        ov = box_overlap(off, size, offsets, sizes)
        if ov is not None:
            raw.append((off, holders, ov))
    problems.extend(_coverage_problems(logical, offsets, sizes, raw))
    hits = []
    for off, holders, (ov_off, ov_size) in raw:
        rel = tuple(o - b for o, b in zip(ov_off, off, strict=True))
        if any(rel):
            srcs = [(rank, local, tuple(lo + r for lo, r in zip(loc, rel, strict=True)))
                    for rank, local, loc in holders]
        else:  # the overlap starts where the source box does (replicas, whole pieces)
            srcs = holders
        dst_off = tuple(lo + o - b for lo, o, b in zip(local_offsets, ov_off, offsets, strict=True))
        hits.append((volume(ov_size), srcs, dst_off, ov_off, ov_size))
    return hits


def _coverage_problems(logical: str, offsets: Box, sizes: Box, hits: list) -> list[str]:
    out = []
    covered = sum(volume(ov[1]) for _, _, ov in hits)
    for i in range(len(hits)):
        for j in range(i + 1, len(hits)):
            both = box_overlap(*hits[i][2], *hits[j][2])
            if both is not None:
                out.append(f"doubled: {logical} offsets={both[0]} sizes={both[1]}")
    if covered < volume(sizes):
        got = sorted((ov[0], ov[1]) for _, _, ov in hits)
        out.append(f"missing: {logical} offsets={offsets} sizes={sizes} has only "
                   f"{covered}/{volume(sizes)} elements in the source (source boxes: {got or 'none'})")
    return out
