"""Transfer plans: the copies that make a destination layout equal a source layout.

Built once from metadata (names, shapes, dtypes, parallel configs).  A plan proves its
coverage: every destination piece is written exactly once, or ``build_plan`` raises
``PlanError`` naming the missing or doubled regions.  It is kept as what it was made of (each
distinct read list once, the holder picked per read): a 1T model into 16 engines has 1.3 M
copies and a broadcast to 256 engine ranks 18 M, while a process needs its own links' copies
only (``copies_from``, ``copies_to``); ``copies`` makes all of them when asked.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, repeat
from math import prod
from operator import itemgetter
from typing import NamedTuple

import numpy as np
import torch

from shardsync.dtypes import torch_dtype
from shardsync.gcpause import gc_paused
from shardsync.layout.base import Layout
from shardsync.layout.raw import width
from shardsync.piece import Box
from shardsync.plan.reads import Read, Reader


class PlanError(ValueError):
    """A plan that cannot be built, with the regions that are missing or doubled."""


class Copy(NamedTuple):
    """Box ``sizes`` at ``src_offsets`` of (src, src_local) -> ``dst_offsets`` of (dst, dst_local).

    A named tuple, not a dataclass: a rank's links hold thousands, a whole 1T plan millions."""

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


_new_copy = tuple.__new__  # a Copy from one tuple, without NamedTuple's Python-level __new__


def dtype_itemsize(dtype: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype)).element_size()


class _Numbers(dict[str, int]):
    """Each name's number, given in first-use order."""

    def __missing__(self, name: str) -> int:
        n = self[name] = len(self)
        return n


class Rider(NamedTuple):
    """A tensor that rides with a lead tensor: its element ``(i, j)`` belongs to the ``rows`` x
    ``cols`` block ``(i, j)`` of the lead, comes from the lead's holder and travels in the lead's
    bucket (a block of quantized words and its scale: 128 x 128 e4m3 blocks are 128 x 32 int32
    words)."""

    name: str
    rows: int
    cols: int


@dataclass(frozen=True)
class Picks:
    """What ``build_plan`` chose: the distinct read lists, the one each destination rank reads,
    and per destination rank each read's holder rank (``None`` where every read of the rank's list
    has one holder).  A rank holding a box twice (a tied embedding) gives its first piece."""

    lists: tuple[tuple[Read, ...], ...]
    order: tuple[int, ...]
    ranks: tuple[np.ndarray | None, ...]

    def digest(self) -> str:
        """The content as numbers (names numbered in first-use order, their text hashed too)."""
        names = _Numbers()
        said: dict[int, int] = {}  # id of a holder list (``lists`` keeps each alive) -> number
        ints, holder_ints = array("q"), array("q")
        for reads in self.lists:
            for _, srcs, _, _, _, local, dst_off, size, logical, logical_off in reads:
                h = said.get(id(srcs))
                if h is None:  # a norm's 64 replicas recur in every layer's reads: described once
                    h = said[id(srcs)] = len(said)
                    holder_ints.append(len(srcs))
                    for rank, src_local, src_off in srcs:
                        holder_ints.extend((rank, names[src_local], *src_off))
                ints.extend((names[logical], names[local], h, *dst_off, *size, *logical_off))
        out = hashlib.sha256("\n".join(names).encode())
        sizes = array("q", (-1 if r is None else len(r) for r in self.ranks))
        for part in (ints, holder_ints, array("q", self.order), sizes):
            if sys.byteorder == "big":  # little-endian on every host
                part.byteswap()
            out.update(part.tobytes())
        for r in self.ranks:
            if r is not None:
                out.update(r.astype("<i4", copy=False).tobytes())
        return out.hexdigest()


@dataclass(frozen=True)
class Plan:
    """Copies from ``src`` ranks to ``dst`` ranks, in (src, dst) order with destination order kept
    per link; bytes count at the wire dtype, except for the logical tensors that move as their
    own bits (``raw``: name -> dtype, ``layout/raw.py``)."""

    src: Layout
    dst: Layout
    picks: Picks = field(repr=False, compare=False)
    wire_dtype: str
    raw: Mapping[str, str] = field(default_factory=dict)
    # lead -> its rider, which comes from the same holder and travels in the same bucket (``Rider``)
    riders: Mapping[str, Rider] = field(default_factory=dict)

    @cached_property
    def itemsize(self) -> int:
        return dtype_itemsize(self.wire_dtype)

    @cached_property
    def rider_names(self) -> frozenset[str]:
        """The tensors that ride with a lead (``riders``)."""
        return frozenset(s.name for s in self.riders.values())

    def width(self, logical: str) -> int:
        """Wire elements one element of ``logical`` takes (``raw.width``)."""
        return width(self.raw.get(logical), self.wire_dtype)

    def _made(self, dst: int, only: Sequence[int] | None = None) -> list[Copy]:
        """Destination rank ``dst``'s copies in read order (``only``: those reads)."""
        reads = self.picks.lists[self.picks.order[dst]]
        ranks = self.picks.ranks[dst]
        pairs: Iterable[tuple[Read, int]]
        if only is None:
            pairs = zip(reads, repeat(-1) if ranks is None else ranks.tolist(), strict=False)
        else:
            pairs = ((reads[i], -1 if ranks is None else int(ranks[i])) for i in only)
        out = []
        for (_, srcs, _, _, _, local, dst_off, size, logical, logical_off), rank in pairs:
            if rank < 0 or srcs[0][0] == rank:
                rank, src_local, src_off = srcs[0]
            else:  # the first piece ``rank`` holds
                src_local, src_off = next((h[1], h[2]) for h in srcs if h[0] == rank)
            out.append(_new_copy(Copy, (rank, src_local, src_off, dst, local, dst_off, size, logical, logical_off)))
        return out

    def copies_to(self, dst: int) -> list[Copy]:
        """Destination rank ``dst``'s copies, in plan order."""
        return sorted(self._made(dst), key=itemgetter(0))

    def copies_from(self, src: int) -> list[Copy]:
        """Source rank ``src``'s copies, in plan order."""
        return [c for dst in range(self.dst.world_size) for c in self.copies_on(src, dst)]

    def copies_on(self, src: int, dst: int) -> list[Copy]:
        """The copies of link ``src -> dst``, in plan order."""
        ranks = self.picks.ranks[dst]
        if ranks is None:
            only = self._one_holder[self.picks.order[dst]].get(src, [])
        else:
            only = np.flatnonzero(ranks == src).tolist()
        return self._made(dst, only) if only else []

    @cached_property
    def _one_holder(self) -> dict[int, dict[int, list[int]]]:
        """Per read list whose reads have one holder each: source rank -> its reads."""
        out: dict[int, dict[int, list[int]]] = defaultdict(dict)
        for lst, r in zip(self.picks.order, self.picks.ranks, strict=True):
            if r is None and lst not in out:
                by: dict[int, list[int]] = defaultdict(list)
                for i, read in enumerate(self.picks.lists[lst]):
                    by[read[1][0][0]].append(i)
                out[lst] = dict(by)
        return out

    @cached_property
    def copies(self) -> tuple[Copy, ...]:
        """Every copy, in plan order (a 1T plan's million: made once, when asked)."""
        by_src: list[list[Copy]] = [[] for _ in range(self.src.world_size)]
        for dst in range(self.dst.world_size):
            for c in self._made(dst):
                by_src[c.src].append(c)
        return tuple(chain.from_iterable(by_src))

    @cached_property
    def fingerprint(self) -> str:
        """Stable across processes and runs: both sides compare it before a byte moves."""
        h = hashlib.sha256()
        h.update(repr((self.src.describe(), self.dst.describe(), self.wire_dtype)).encode())
        if self.raw:
            h.update(repr(sorted(self.raw.items())).encode())
        if self.riders:  # riders travel with their leads: the buckets differ
            h.update(repr(sorted(self.riders.items())).encode())
        for lay in (self.src, self.dst):  # replicas (DP, identical engines) share one tensors tuple: said once
            said: dict[int, int] = {}
            for r in lay.ranks:
                if id(r.tensors) not in said:
                    said[id(r.tensors)] = len(said)
                    h.update(repr([(t.name, t.shape, t.dtype) for t in r.tensors]).encode())
            h.update(repr([said[id(r.tensors)] for r in lay.ranks]).encode())
        h.update(self.picks.digest().encode())
        return h.hexdigest()[:16]

    @cached_property
    def link_bytes(self) -> dict[tuple[int, int], int]:
        """Bytes per (src, dst) link, summed per read list without making the copies."""
        size = [np.array([prod(r[7]) * self.itemsize * (self.width(r[8]) if self.raw else 1) for r in reads],
                         dtype=np.float64) for reads in self.picks.lists]
        one: dict[int, dict[int, int]] = {}  # per one-holder list: source rank -> its reads' bytes
        out: dict[tuple[int, int], int] = {}
        for dst, (lst, ranks) in enumerate(zip(self.picks.order, self.picks.ranks, strict=True)):
            if ranks is None:
                if lst not in one:
                    one[lst] = {s: int(round(size[lst][reads].sum())) for s, reads in self._one_holder[lst].items()}
                out.update(((s, dst), b) for s, b in one[lst].items())
            else:
                per_src = np.bincount(ranks, weights=size[lst], minlength=self.src.world_size)
                out.update(((int(s), dst), int(round(per_src[s]))) for s in np.flatnonzero(per_src))
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

    def is_whole(self, c: Copy) -> tuple[bool, bool]:
        """Whether a copy spans its entire source / destination local tensor (no pack copy)."""
        s = self.src.ranks[c.src].tensor(c.src_local).shape
        d = self.dst.ranks[c.dst].tensor(c.dst_local).shape
        return (c.sizes == s and not any(c.src_offsets), c.sizes == d and not any(c.dst_offsets))


@dataclass(frozen=True)
class Wire:
    """What a plan carries besides its layouts: the wire dtype (None: the destination's), the
    logical tensors that move as their own bits (``raw``: name -> dtype, ``layout/raw.py``) and
    leads -> their riders (``riders``, ``Rider``).  A topology makes one for
    all its plans from its views."""

    dtype: str | None = None
    raw: Mapping[str, str] = field(default_factory=dict)
    riders: Mapping[str, Rider] = field(default_factory=dict)


@gc_paused
def build_plan(src: Layout, dst: Layout, wire: Wire = Wire()) -> Plan:
    """Intersect ``src`` with ``dst``; replicated source pieces go to the least-loaded holder
    (destination ranks in order, each rank's reads in order, ties to the lower rank), a block
    rider to its lead's holder (``wire.riders``)."""
    riders = wire.riders
    if src.spec.name != dst.spec.name or src.logical != dst.logical:
        raise PlanError(f"layouts describe different models: {src.spec.name} vs {dst.spec.name}")
    problems: list[str] = []
    reader = Reader(src, problems)
    leads = {s.name: (lead, s) for lead, s in riders.items()}  # rider -> its lead
    # Identical engines share one pieces tuple (concat_layouts), so a rank's reads are listed once
    # per distinct tuple, leaving only the holder choice per read.  ``dst`` keeps every tuple
    # alive for the whole build, so ids stay unique.
    list_of: dict[int, int] = {}
    lists: list[tuple[Read, ...]] = []
    # per list: the loads its reads add when each has one holder (no choice to make), else None
    fixed: list[dict[int, int] | None] = []
    load = [0] * src.world_size
    order: list[int] = []
    ranks: list[np.ndarray | None] = []
    for rl in dst.ranks:
        i = list_of.get(id(rl.pieces))
        if i is None:
            i = list_of[id(rl.pieces)] = len(lists)
            reads = tuple(reader(rl.pieces))
            lists.append(reads)
            fixed.append(_one_holder_loads(reads))
        order.append(i)
        adds = fixed[i]
        if adds is None:
            chosen = _choose(lists[i], load)
            ranks.append(_follow(lists[i], chosen, riders, leads) if riders else chosen)
        else:
            for rank, n in adds.items():
                load[rank] += n
            ranks.append(None)
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise PlanError(
            f"cannot plan {src.describe()} -> {dst.describe()}: destination regions not covered "
            f"exactly once:\n  {shown}{more}"
        )
    picks = Picks(tuple(lists), tuple(order), tuple(ranks))
    return Plan(src, dst, picks, wire.dtype or dst.ranks[0].tensors[0].dtype, dict(wire.raw), dict(riders))


def _follow(reads: tuple[Read, ...], ranks: np.ndarray, riders: Mapping[str, Rider],
            leads: Mapping[str, tuple[str, Rider]]) -> np.ndarray:
    """``ranks`` with each rider's read given to the holder its lead's read went to, where it
    holds the rider too (a trainer rank quantizes its words and scales together): a bucket can
    then carry both (``plan.bucket``).  The loads keep the first choice (riders are small).
    ``leads``: ``riders`` the other way round."""
    went: dict[tuple[str, int, int], int] = {}  # (lead, first block row, first block column) -> holder
    out = ranks.copy()
    for i, (_, srcs, _, second, _, _, _, _, logical, logical_off) in enumerate(reads):
        if second < 0:  # one holder: nothing to choose (its words had one too)
            continue
        s = riders.get(logical)
        if s is not None:
            went[(logical, logical_off[0] // s.rows, logical_off[1] // s.cols)] = int(out[i])
            continue
        lead = leads.get(logical)
        if lead is not None:
            rank = went.get((lead[0], logical_off[0], logical_off[1]))
            if rank is not None and any(h[0] == rank for h in srcs):
                out[i] = rank
    return out


def _one_holder_loads(reads: tuple[Read, ...]) -> dict[int, int] | None:
    """The elements a list's reads add to each holder when every read has one (broadcasts, TP
    shards into their own engine layout), else None: such a list needs no choice per read."""
    adds: dict[int, int] = defaultdict(int)
    for numel, _, first, second, _, _, _, _, _, _ in reads:
        if second >= 0:
            return None
        adds[first] += numel
    return dict(adds)


def _choose(reads: tuple[Read, ...], load: list[int]) -> np.ndarray:
    """Give each of one destination rank's reads to its first least-loaded holder (its rank).

    The hot loop of a plan (once per copy: 1.3 M times for Kimi-K2), so a source box of two
    holders (an expert under expert-DP 2) compares their loads inline instead of through a
    tuple of loads."""
    rank_of = array("i")
    put = rank_of.append
    for numel, srcs, first, second, loads_of, _, _, _, _, _ in reads:
        if second < 0:
            rank = first
        elif loads_of is None:
            rank = second if load[second] < load[first] else first
        else:  # holders are in rank order: the first least-loaded is the (load, rank) minimum
            loads = loads_of(load)
            rank = srcs[loads.index(min(loads))][0]
        load[rank] += numel
        put(rank)
    return np.frombuffer(rank_of, dtype=np.intc)
