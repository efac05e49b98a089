"""Reads: the source boxes each destination piece covers, their holders still to choose.

A destination rank's read list is made once per distinct pieces tuple (identical engines, DP
replicas share one); ``build_plan`` then only picks a holder per read.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from operator import itemgetter

from shardsync.layout.base import Layout
from shardsync.piece import Box, Piece, box_overlap, volume

Holders = list[tuple[int, str, Box]]  # [(rank, local, local offsets)], in rank order
# The holders' loads out of the per-rank load list (``_loads``); None for one or two holders.
Loads = Callable[[list[int]], tuple[int, ...]] | None
# One source box a destination piece reads: (numel, holders, their loads, dst local offsets,
# logical offsets, sizes).
Hit = tuple[int, Holders, Loads, Box, Box, Box]
# One copy a destination rank receives, its holder still to choose: (numel, holders, first and
# second holder's rank (-1: one holder), the holders' loads (more than two), dst local, dst local
# offsets, sizes, logical, logical offsets).
Read = tuple[int, Holders, int, int, Loads, str, Box, Box, str, Box]


class Reader:
    """The copies a destination rank's pieces read, holders unchosen (see ``Read``)."""

    def __init__(self, src: Layout, problems: list[str]) -> None:
        # logical -> {(offsets, sizes): holders [(rank, local, local_offsets)]}, holders in rank order
        index: dict[str, dict[tuple[Box, Box], Holders]] = defaultdict(dict)
        for rank, rl in enumerate(src.ranks):
            for p in rl.pieces:
                index[p.logical].setdefault((p.offsets, p.sizes), []).append((rank, p.local, p.local_offsets))
        # logical -> [((offsets, sizes), holders, their loads)]
        self.boxes = {k: [(box, holders, _loads(holders)) for box, holders in v.items()] for k, v in index.items()}
        # (logical, offsets, sizes) -> (holders, their loads): a piece that is exactly a source box
        # (a whole expert, a broadcast's whole tensor) reads it alone when the boxes are disjoint
        self.exact = {(k, *box): (holders, loads_of) for k, v in self.boxes.items() for box, holders, loads_of in v}
        self.problems = problems
        # (logical box, local offsets) -> its hits: identical pieces are intersected once.
        self.cache: dict[tuple[str, Box, Box, Box], list[Hit]] = {}
        self.disjoint: dict[str, bool] = {}

    def __call__(self, pieces: tuple[Piece, ...]) -> list[Read]:
        out: list[Read] = []
        for p in pieces:
            for numel, srcs, loads_of, dst_off, ov_off, ov_size in self.hits(p):
                first, second = (srcs[0][0], srcs[1][0]) if len(srcs) > 1 else (srcs[0][0], -1)
                out.append((numel, srcs, first, second, loads_of, p.local, dst_off, ov_size, p.logical, ov_off))
        return out

    def hits(self, p: Piece) -> list[Hit]:
        disjoint = self.disjoint.get(p.logical)
        if disjoint is None:
            disjoint = self.disjoint[p.logical] = _disjoint(self.boxes.get(p.logical, []))
        if disjoint:
            same = self.exact.get((p.logical, p.offsets, p.sizes))
            if same is not None:
                return [(volume(p.sizes), same[0], same[1], p.local_offsets, p.offsets, p.sizes)]
        key = (p.logical, p.offsets, p.sizes, p.local_offsets)
        hits = self.cache.get(key)
        if hits is None:
            hits = self.cache[key] = _hits(p.logical, p.offsets, p.sizes, p.local_offsets,
                                           self.boxes.get(p.logical, []), disjoint, self.problems)
        return hits


def _disjoint(boxes: list) -> bool:
    return all(box_overlap(*a[0], *b[0]) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])


def _hits(logical: str, offsets: Box, sizes: Box, local_offsets: Box, boxes: list, disjoint: bool,
          problems: list[str]) -> list[Hit]:
    """The source boxes one destination piece reads (see ``Hit``)."""
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
    hits: list[Hit] = []
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


def _loads(holders: Holders) -> Loads:
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
