"""Transfer plans: the copy list that makes a destination layout equal a source layout.

Built once from metadata (names, shapes, dtypes, parallel configs).  A plan proves its
coverage: every destination piece is written exactly once, or ``build_plan`` raises
``PlanError`` naming the missing or doubled regions.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from math import prod
from operator import itemgetter
from typing import NamedTuple

import torch

from shardsync.dtypes import torch_dtype
from shardsync.gcpause import gc_paused
from shardsync.layout.piece import Box, Layout, Piece, box_overlap, volume
from shardsync.layout.raw import width


class PlanError(ValueError):
    """A plan that cannot be built, with the regions that are missing or doubled."""


class Copy(NamedTuple):
    """Box ``sizes`` at ``src_offsets`` of (src, src_local) -> ``dst_offsets`` of (dst, dst_local).

    A named tuple, not a dataclass: a 235B plan holds ~10^5 of them, a 1T one (Kimi-K2 into 16
    engines) 1.3 x 10^6."""

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
        return prod(self.sizes)  # ``volume``, in C: plans sum it over a million copies


class _Reprs(dict[object, str]):
    """``repr`` of each key, made on first use."""

    def __missing__(self, key: object) -> str:
        r = self[key] = repr(key)
        return r


def dtype_itemsize(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


@dataclass(frozen=True)
class Plan:
    """Copies from ``src`` ranks to ``dst`` ranks; bytes count at the wire dtype, except for
    the logical tensors that move as their own bits (``raw``: name -> dtype, ``layout/raw.py``)."""

    src: Layout
    dst: Layout
    copies: tuple[Copy, ...]
    wire_dtype: str
    raw: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def itemsize(self) -> int:
        return dtype_itemsize(self.wire_dtype)

    def width(self, logical: str) -> int:
        """Wire elements one element of ``logical`` takes (``raw.width``)."""
        return width(self.raw.get(logical), self.wire_dtype)

    @cached_property
    def fingerprint(self) -> str:
        """Stable across processes and runs: both sides compare it before a byte moves."""
        h = hashlib.sha256()
        h.update(repr((self.src.describe(), self.dst.describe(), self.wire_dtype)).encode())
        if self.raw:
            h.update(repr(sorted(self.raw.items())).encode())
        for lay in (self.src, self.dst):
            for r in lay.ranks:
                h.update(repr([(t.name, t.shape, t.dtype) for t in r.tensors]).encode())
        # Each copy hashes as repr((src, src_local, src_offsets, dst, dst_local, dst_offsets,
        # sizes)).  A 1T plan's million copies repeat a few thousand ranks, names and boxes (all
        # ints and strs), so each field's repr is made once; blocks of copies go to the hash.
        rep = _Reprs()
        block = 1 << 16
        for i in range(0, len(self.copies), block):
            h.update("".join([f"({rep[s]}, {rep[sl]}, {rep[so]}, {rep[d]}, {rep[dl]}, {rep[do]}, {rep[sz]})"
                              for s, sl, so, d, dl, do, sz, _, _ in self.copies[i:i + block]]).encode())
        return h.hexdigest()[:16]

    @cached_property
    def link_bytes(self) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = defaultdict(int)
        for c in self.copies:
            out[(c.src, c.dst)] += c.numel * self.itemsize * (self.width(c.logical) if self.raw else 1)
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


_Holders = list[tuple[int, str, Box]]  # [(rank, local, local offsets)], in rank order
# The holders' loads out of the per-rank load list (``_loads``); None for one or two holders.
_Loads = Callable[[list[int]], tuple[int, ...]] | None
# One source box a destination piece reads: (numel, holders, their loads, dst local offsets,
# logical offsets, sizes).
_Hit = tuple[int, _Holders, _Loads, Box, Box, Box]
# One copy a destination rank receives, its holder still to choose: (numel, holders, first and
# second holder's rank (-1: one holder), the holders' loads (more than two), dst local, dst local
# offsets, sizes, logical, logical offsets).
_Read = tuple[int, _Holders, int, int, _Loads, str, Box, Box, str, Box]
_new_copy = tuple.__new__  # a Copy from one tuple, without NamedTuple's Python-level __new__


@gc_paused
def build_plan(src: Layout, dst: Layout, *, wire_dtype: str | None = None,
               raw: Mapping[str, str] | None = None) -> Plan:
    """Intersect ``src`` with ``dst``; replicated source pieces go to the least-loaded holder.
    ``raw``: the logical tensors that move as their own bits (``layout/raw.py``)."""
    if src.spec.name != dst.spec.name or src.logical != dst.logical:
        raise PlanError(f"layouts describe different models: {src.spec.name} vs {dst.spec.name}")
    problems: list[str] = []
    reads = _Reader(src, problems)
    # Identical engines share one pieces tuple (concat_layouts), so a rank's reads are listed once
    # per distinct tuple, leaving only the holder choice per copy.  ``dst`` keeps every tuple
    # alive for the whole build, so ids stay unique.
    rank_reads: dict[int, list[_Read]] = {}
    # Copies per source rank, each in destination order: their concatenation is the plan sorted
    # by (src, dst) with destination order kept per link.
    by_src: list[list[Copy]] = [[] for _ in range(src.world_size)]
    load = [0] * src.world_size
    for dst_rank, rl in enumerate(dst.ranks):
        mine = rank_reads.get(id(rl.pieces))
        if mine is None:
            mine = rank_reads[id(rl.pieces)] = reads(rl.pieces)
        _assign(dst_rank, mine, load, by_src)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanError(
            f"cannot plan {src.describe()} -> {dst.describe()}: destination regions not covered "
            f"exactly once:\n  {shown}{more}"
        )
    copies = tuple(chain.from_iterable(by_src))
    return Plan(src, dst, copies, wire_dtype or dst.ranks[0].tensors[0].dtype, dict(raw or {}))


def _assign(dst_rank: int, reads: list[_Read], load: list[int], by_src: list[list[Copy]]) -> None:
    """Give each of one destination rank's copies to its first least-loaded holder.

    The hot loop of a plan (once per copy: 1.3 M times for Kimi-K2), so a source box of two
    holders (an expert under expert-DP 2) compares their loads inline instead of through a
    tuple of loads."""
    for numel, srcs, first, second, loads_of, local, dst_off, ov_size, logical, ov_off in reads:
        if second < 0:
            rank, src_local, src_off = srcs[0]
        elif loads_of is None:
            rank, src_local, src_off = srcs[1 if load[second] < load[first] else 0]
        else:  # holders are in rank order: the first least-loaded is the (load, rank) minimum
            loads = loads_of(load)
            rank, src_local, src_off = srcs[loads.index(min(loads))]
        load[rank] += numel
        by_src[rank].append(_new_copy(Copy, (rank, src_local, src_off, dst_rank, local, dst_off, ov_size,
                                             logical, ov_off)))


class _Reader:
    """The copies a destination rank's pieces read, holders unchosen (see ``_Read``)."""

    def __init__(self, src: Layout, problems: list[str]) -> None:
        # logical -> {(offsets, sizes): holders [(rank, local, local_offsets)]}, holders in rank order
        index: dict[str, dict[tuple[Box, Box], _Holders]] = defaultdict(dict)
        for rank, rl in enumerate(src.ranks):
            for p in rl.pieces:
                index[p.logical].setdefault((p.offsets, p.sizes), []).append((rank, p.local, p.local_offsets))
        # logical -> [((offsets, sizes), holders, their loads)]
        self.boxes = {k: [(box, holders, _loads(holders)) for box, holders in v.items()] for k, v in index.items()}
        self.problems = problems
        # (logical box, local offsets) -> its hits: identical pieces are intersected once.
        self.cache: dict[tuple[str, Box, Box, Box], list[_Hit]] = {}
        self.disjoint: dict[str, bool] = {}

    def __call__(self, pieces: tuple[Piece, ...]) -> list[_Read]:
        out: list[_Read] = []
        for p in pieces:
            for numel, srcs, loads_of, dst_off, ov_off, ov_size in self.hits(p):
                first, second = (srcs[0][0], srcs[1][0]) if len(srcs) > 1 else (srcs[0][0], -1)
                out.append((numel, srcs, first, second, loads_of, p.local, dst_off, ov_size, p.logical, ov_off))
        return out

    def hits(self, p: Piece) -> list[_Hit]:
        key = (p.logical, p.offsets, p.sizes, p.local_offsets)
        hits = self.cache.get(key)
        if hits is None:
            mine = self.boxes.get(p.logical, [])
            if p.logical not in self.disjoint:
                self.disjoint[p.logical] = _disjoint(mine)
            hits = self.cache[key] = _hits(p.logical, p.offsets, p.sizes, p.local_offsets, mine,
                                           self.disjoint[p.logical], self.problems)
        return hits


def _disjoint(boxes: list) -> bool:
    return all(box_overlap(*a[0], *b[0]) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _hits(logical: str, offsets: Box, sizes: Box, local_offsets: Box, boxes: list, disjoint: bool,
          problems: list[str]) -> list[_Hit]:
    """The source boxes one destination piece reads (see ``_Hit``)."""
    if disjoint:  # a piece inside one of disjoint source boxes (TP shards, a whole tensor) reads it alone
        for (off, size), holders, loads_of in boxes:
            if all(o <= q and q + n <= o + m for o, m, q, n in zip(off, size, offsets, sizes, strict=True)):
                rel = tuple(q - o for q, o in zip(offsets, off, strict=True))
                srcs = holders if not any(rel) else [
                    (rank, local, tuple(lo + r for lo, r in zip(loc, rel, strict=True)))
                    for rank, local, loc in holders]
                return [(volume(sizes), srcs, loads_of, local_offsets, offsets, sizes)]
    raw = []
    for (off, size), holders, loads_of in boxes:
        ov = box_overlap(off, size, offsets, sizes)
        if ov is not None:
            raw.append((off, holders, loads_of, ov))
    problems.extend(_coverage_problems(logical, offsets, sizes, [ov for *_, ov in raw]))
    hits: list[_Hit] = []
    for off, holders, loads_of, (ov_off, ov_size) in raw:
        rel = tuple(o - b for o, b in zip(ov_off, off, strict=True))
        if any(rel):
            srcs = [(rank, local, tuple(lo + r for lo, r in zip(loc, rel, strict=True)))
                    for rank, local, loc in holders]
        else:  # the overlap starts where the source box does (replicas, whole pieces)
            srcs = holders
        dst_off = tuple(lo + o - b for lo, o, b in zip(local_offsets, ov_off, offsets, strict=True))
        hits.append((volume(ov_size), srcs, loads_of, dst_off, ov_off, ov_size))
    return hits


def _loads(holders: _Holders) -> _Loads:
    """The holders' entries of a per-rank list in one call, made once per source box: the choice
    among a box's replicas (64 for a norm under TP8 x DP8) runs per copy, 1.3 M times for Kimi-K2.
    One or two holders need none (``_assign`` compares two loads inline)."""
    return None if len(holders) <= 2 else itemgetter(*(rank for rank, _, _ in holders))


def _coverage_problems(logical: str, offsets: Box, sizes: Box, overlaps: list[tuple[Box, Box]]) -> list[str]:
    out = []
    covered = sum(volume(ov[1]) for ov in overlaps)
    for i in range(len(overlaps)):
        for j in range(i + 1, len(overlaps)):
            both = box_overlap(*overlaps[i], *overlaps[j])
            if both is not None:
                out.append(f"doubled: {logical} offsets={both[0]} sizes={both[1]}")
    if covered < volume(sizes):
        got = sorted(overlaps)
        out.append(f"missing: {logical} offsets={offsets} sizes={sizes} has only "
                   f"{covered}/{volume(sizes)} elements in the source (source boxes: {got or 'none'})")
    return out
