"""Buckets: a link's copies grouped under a byte budget, packed into one flat buffer.

Bucketing is pure (plan in, bucket list out) so that both ends derive the same buckets
from the same plan without exchanging any per-bucket metadata.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from math import prod

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


def split_copy(c: Copy, max_numel: int) -> list[Copy]:
    """Split a copy along its first non-unit dim so each part fits ``max_numel`` elements."""
    if c.numel <= max_numel:
        return [c]
    dim = next(i for i, s in enumerate(c.sizes) if s > 1)
    # One row along ``dim`` is the smallest unit; a row above the budget gets a bucket alone.
    step = max(1, max_numel // (c.numel // c.sizes[dim]))
    parts = []
    for start in range(0, c.sizes[dim], step):
        n = min(step, c.sizes[dim] - start)

        def shift(box: tuple[int, ...], start: int = start) -> tuple[int, ...]:
            return tuple(b + start if i == dim else b for i, b in enumerate(box))

        sizes = tuple(n if i == dim else s for i, s in enumerate(c.sizes))
        parts.append(c._replace(src_offsets=shift(c.src_offsets), dst_offsets=shift(c.dst_offsets),
                                   logical_offsets=shift(c.logical_offsets), sizes=sizes))
    return parts


@gc_paused
def make_buckets(plan: Plan, budget_bytes: int, copies: Iterable[Copy] | None = None) -> list[Bucket]:
    """Buckets per link in plan order; a copy above the budget is split into row blocks.  A copy
    that moves as its own bits (``Plan.raw``) takes its bytes' worth of wire elements, at an
    offset that is a multiple of its width (a buffer view as a wider dtype starts on a whole
    element).  ``copies``: whole links of the plan, in plan order (one rank's: ``copies_from``,
    ``copies_to``), for their buckets only; all of the plan's by default."""
    if budget_bytes < plan.itemsize:
        raise ValueError(f"bucket budget {budget_bytes} B is smaller than one element")
    max_numel = budget_bytes // plan.itemsize
    out: list[Bucket] = []
    # the open bucket: its copies, their offsets and its size (each copy's numel counted once:
    # a trillion-parameter plan has over a million copies)
    current: list[Copy] = []
    offsets: list[int] = []
    used = 0
    link: tuple[int, int] | None = None
    counters: dict[tuple[int, int], int] = {}
    raw = plan.raw

    def flush() -> None:
        nonlocal current, offsets, used
        if current and link is not None:
            idx = counters.get(link, 0)
            counters[link] = idx + 1
            out.append(Bucket(link[0], link[1], idx, tuple(current), tuple(offsets), used))
        current, offsets, used = [], [], 0

    for c in plan.copies if copies is None else copies:
        if (c.src, c.dst) != link:
            flush()
            link = (c.src, c.dst)
        if raw and c.logical in raw:  # rare: a few small tensors per layer
            w = plan.width(c.logical)
            for part in split_copy(c, max(1, max_numel // w)):
                start = -(-used // w) * w
                if start + part.numel * w > max_numel and current:
                    flush()
                    start = 0
                current.append(part)
                offsets.append(start)
                used = start + part.numel * w
            continue
        numel = prod(c.sizes)
        parts = [(c, numel)] if numel <= max_numel else [
            (part, prod(part.sizes)) for part in split_copy(c, max_numel)]
        for part, n in parts:
            if used + n > max_numel:
                flush()
            current.append(part)
            offsets.append(used)
            used += n
    flush()
    return out
