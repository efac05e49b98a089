"""Buckets: a link's copies grouped under a byte budget, packed into one flat buffer.

Bucketing is pure (plan in, bucket list out) so that both ends derive the same buckets
from the same plan without exchanging any per-bucket metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from math import prod
from operator import itemgetter

from shardsync.gcpause import gc_paused
from shardsync.plan.plan import Copy, Plan


@dataclass(frozen=True)
class Bucket:
    """Copies of one (src, dst) link; copy ``i`` occupies ``[offsets[i], offsets[i]+numel)``."""

    src: int
    dst: int
    index: int
    copies: tuple[Copy, ...]
    offsets: tuple[int, ...]
    numel: int


def _part(c: Copy, dim: int, start: int, n: int) -> Copy:
    """The part ``start:start+n`` of a copy along ``dim``."""
    def at(box: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(b + start if i == dim else b for i, b in enumerate(box))

    sizes = tuple(n if i == dim else s for i, s in enumerate(c.sizes))
    return c._replace(src_offsets=at(c.src_offsets), dst_offsets=at(c.dst_offsets),
                      logical_offsets=at(c.logical_offsets), sizes=sizes)


def split_copy(c: Copy, max_numel: int) -> list[Copy]:
    """Split a copy along its first non-unit dim so each part fits ``max_numel`` elements."""
    if c.numel <= max_numel:
        return [c]
    dim = next(i for i, s in enumerate(c.sizes) if s > 1)
    # One row along ``dim`` is the smallest unit; a row above the budget gets a bucket alone.
    step = max(1, max_numel // (c.numel // c.sizes[dim]))
    return [_part(c, dim, start, min(step, c.sizes[dim] - start)) for start in range(0, c.sizes[dim], step)]


def _partners(plan: Plan, copies: list[Copy]) -> dict[int, int]:
    """Index of each lead's copy -> that of the copy of exactly its blocks' rider (``Plan.riders``)."""
    names = plan.rider_names
    where = {(c.logical, c.logical_offsets, c.sizes): i for i, c in enumerate(copies) if c.logical in names}
    out = {}
    for i, c in enumerate(copies):
        s = plan.riders.get(c.logical)
        if s is None:
            continue
        (r, w), (n, m) = c.logical_offsets[:2], c.sizes[:2]
        first = (r // s.rows, w // s.cols)
        j = where.get((s.name, first, (-(-(r + n) // s.rows) - first[0], -(-(w + m) // s.cols) - first[1])))
        if j is not None:
            out[i] = j
    return out


class _Filler:
    """Fills one link's buckets in order (``make_buckets``)."""

    def __init__(self, plan: Plan, max_numel: int, out: list[Bucket], counters: dict[tuple[int, int], int],
                 link: tuple[int, int]) -> None:
        self.plan, self.max_numel, self.out, self.counters, self.link = plan, max_numel, out, counters, link
        self.current: list[Copy] = []
        self.offsets: list[int] = []
        self.used = 0

    def flush(self) -> None:
        if self.current:
            idx = self.counters.get(self.link, 0)
            self.counters[self.link] = idx + 1
            self.out.append(Bucket(*self.link, idx, tuple(self.current), tuple(self.offsets), self.used))
        self.current, self.offsets, self.used = [], [], 0

    def put(self, c: Copy, w: int, numel: int) -> None:
        """Place ``c`` (``numel`` elements of ``w`` wire elements each) at a whole element of its width."""
        start = -(-self.used // w) * w
        self.current.append(c)
        self.offsets.append(start)
        self.used = start + numel * w

    def copy(self, c: Copy) -> None:
        """A copy alone; above the budget it is split into row blocks."""
        plan, max_numel = self.plan, self.max_numel
        if plan.raw and c.logical in plan.raw:  # rare: a few small tensors per layer
            w = plan.width(c.logical)
            for part in split_copy(c, max(1, max_numel // w)):
                if -(-self.used // w) * w + part.numel * w > max_numel and self.current:
                    self.flush()
                self.put(part, w, part.numel)
            return
        numel = prod(c.sizes)
        parts = [(c, numel)] if numel <= max_numel else [(part, prod(part.sizes)) for part in split_copy(c, max_numel)]
        for part, n in parts:
            if self.used + n > max_numel:
                self.flush()
            self.put(part, 1, n)

    def ride(self, c: Copy, sc: Copy) -> None:
        """A lead with its rider: whole block rows of both in each bucket, a block row above the
        budget in a bucket alone."""
        rows = self.plan.riders[c.logical].rows
        wc, ws = self.plan.width(c.logical), self.plan.width(sc.logical)
        per_row, per_scale_row = prod(c.sizes[1:]), prod(sc.sizes[1:])

        def end(i: int, k: int) -> int:  # where block rows i:i+k of both would end in the open bucket
            n = min(k * rows, c.sizes[0] - i * rows) * per_row
            words_end = -(-self.used // wc) * wc + n * wc
            return -(-words_end // ws) * ws + k * per_scale_row * ws

        i, total = 0, sc.sizes[0]
        while i < total:
            lo, hi = 0, total - i  # the most block rows that fit: a binary search, ends are monotone
            if end(i, hi) <= self.max_numel:  # the rest fits (the common case)
                lo = hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if end(i, mid) <= self.max_numel else (lo, mid - 1)
            if lo == 0 and self.current:
                self.flush()
                continue
            k = max(lo, 1)
            n = min(k * rows, c.sizes[0] - i * rows)
            whole = k == total  # both whole (the common case): no parts made
            self.put(c if whole else _part(c, 0, i * rows, n), wc, n * per_row)
            self.put(sc if whole else _part(sc, 0, i, k), ws, k * per_scale_row)
            i += k


@gc_paused
def make_buckets(plan: Plan, budget_bytes: int, copies: Iterable[Copy] | None = None) -> list[Bucket]:
    """Buckets per link in plan order; a copy above the budget is split into row blocks.  A copy
    that moves as its own bits (``Plan.raw``) takes its bytes' worth of wire elements, at an
    offset that is a multiple of its width (a buffer view as a wider dtype starts on a whole
    element).  A rider travels with its lead (``Plan.riders``: quantized words with their block
    scales): a bucket never holds a block without its rider.  ``copies``: whole links of the plan, in plan order (one
    rank's: ``copies_from``, ``copies_to``), for their buckets only; all of the plan's by default."""
    if budget_bytes < plan.itemsize:
        raise ValueError(f"bucket budget {budget_bytes} B is smaller than one element")
    max_numel = budget_bytes // plan.itemsize
    out: list[Bucket] = []
    counters: dict[tuple[int, int], int] = {}
    for link, group in groupby(plan.copies if copies is None else copies, key=itemgetter(0, 3)):
        filler = _Filler(plan, max_numel, out, counters, link)
        if not plan.riders:
            for c in group:
                filler.copy(c)
        else:
            items = list(group)
            partner = _partners(plan, items)
            taken = set(partner.values())
            for i, c in enumerate(items):
                if i in partner:
                    filler.ride(c, items[partner[i]])
                elif i not in taken:
                    filler.copy(c)
        filler.flush()
    return out
