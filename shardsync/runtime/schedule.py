"""Compile plans into per-rank step lists (pure: metadata in, steps out).

Sync-group ranks: trainer ranks first (``0..T-1``, Megatron order), then every engine
rank (engine i's ranks after engine i-1's).  Every rank compiles its own steps from the
same plans, in one global order, so no per-bucket metadata crosses the wire.  A rank's
steps are compiled once per (topology, rank, budget) and shared by whoever asks (a staging
window's write order, then the path's program).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

from shardsync.layout.raw import width
from shardsync.piece import box_overlap
from shardsync.plan.bucket import Bucket, make_buckets
from shardsync.plan.plan import Copy, Plan
from shardsync.runtime.steps import Binding, Step, SubRecv, full_region
from shardsync.topology import Topology


def _region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def _rel(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x - y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class SyncRanks:
    """Sync-group rank numbering for a topology."""

    topo: Topology

    @property
    def trainer_world(self) -> int:
        return self.topo.trainer.world_size

    @property
    def world_size(self) -> int:
        return self.trainer_world + self.topo.num_engine_ranks

    def engine(self, engine_rank: int) -> int:
        """Sync rank of a global engine rank (index into ``topo.engines_layout``)."""
        return self.trainer_world + engine_rank

    def describe(self, rank: int) -> str:
        """A sync rank as an operator knows it (errors name peers this way)."""
        if rank < self.trainer_world:
            return f"trainer rank {rank}"
        engine_rank, engine = rank - self.trainer_world, 0
        while engine_rank >= self.topo.engines[engine].world_size:
            engine_rank -= self.topo.engines[engine].world_size
            engine += 1
        return f"engine {engine} rank {engine_rank} (sync rank {rank})"

    def stage_group(self, stage: int) -> list[int]:
        """Broadcast group of a stage: its source first, then every engine rank."""
        src = self.topo.stage_ranks(stage)[0]
        return [src] + [self.engine(e) for e in range(self.topo.num_engine_ranks)]


def merge_bindings(bindings: list[Binding]) -> tuple[Binding, ...]:
    """Fuse neighbours that are contiguous both in the tensor (along dim 0) and in the buffer.

    Aligned TP makes fc1's gate and up halves (and a one-group QKV shard) such neighbours:
    merged, they cover the whole tensor and the executor skips the pack/unpack copy.
    """
    out: list[Binding] = []
    for b in bindings:
        p = out[-1] if out else None
        if (p is not None and p.key == b.key and p.space == b.space and p.raw is None and b.raw is None
                and p.sub == full_region(p.box) and b.sub == full_region(b.box)
                and p.region[1:] == b.region[1:] and p.region[0].stop == b.region[0].start
                and p.offset + p.numel == b.offset and p.box[1:] == b.box[1:]):
            box = (p.box[0] + b.box[0],) + p.box[1:]
            out[-1] = Binding(p.key, (slice(p.region[0].start, b.region[0].stop),) + p.region[1:],
                              p.offset, box, full_region(box), p.space)
        else:
            out.append(b)
    return tuple(out)


@functools.lru_cache(maxsize=16)
def p2p_steps(topo: Topology, me: int, budget_bytes: int) -> tuple[Step, ...]:
    """Steps of sync rank ``me`` for the shard-to-shard plan (and its relays, if any).

    A relaying engine rank forwards only after it received everything (a fenced step):
    store and forward, so the trainer's links carry one copy of the model whatever the
    number of engines.
    """
    ranks = SyncRanks(topo)
    steps = _link_steps(topo.p2p_plan, me, budget_bytes, lambda s: s, ranks.engine)
    for i, plan in enumerate(topo.relay_plans):
        a, b = topo.engine_rank_offset(i), topo.engine_rank_offset(i + 1)
        relay = _link_steps(plan, me, budget_bytes, lambda s, a=a: ranks.engine(a + s),
                            lambda d, b=b: ranks.engine(b + d), label=f"relay{i}")
        if relay and relay[0].comm[0] == "send":
            relay[0] = dataclasses.replace(relay[0], fence=True)
        steps += relay
    return tuple(steps)  # cached (lru_cache): shared, never mutated


def _link_steps(plan: Plan, me: int, budget_bytes: int, src_rank, dst_rank, label: str = "p2p") -> list[Step]:
    # only the links ``me`` is on: a 1T plan's other million copies are never made here
    mine = [c for s in range(plan.src.world_size) if src_rank(s) == me for c in plan.copies_from(s)]
    mine += [c for d in range(plan.dst.world_size) if dst_rank(d) == me
             for c in plan.copies_to(d) if src_rank(c.src) != me]
    buckets = sorted(make_buckets(plan, budget_bytes, mine), key=lambda b: (b.index, b.src, b.dst))
    steps = []
    raw = plan.raw
    for b in buckets:
        src, dst = src_rank(b.src), dst_rank(b.dst)
        link = f"{plan.src.ranks[b.src].label}->{plan.dst.ranks[b.dst].label}"
        if me == src:
            pack = merge_bindings([Binding(c.src_local, _region(c.src_offsets, c.sizes), off, c.sizes,
                                           full_region(c.sizes), raw=raw.get(c.logical))
                                   for c, off in zip(b.copies, b.offsets, strict=True)])
            steps.append(Step(f"{label}{b.index}", b.numel, ("send", dst), pack=pack, link=link))
        elif me == dst:
            drain = merge_bindings([Binding(c.dst_local, _region(c.dst_offsets, c.sizes), off, c.sizes,
                                            full_region(c.sizes), raw=raw.get(c.logical))
                                    for c, off in zip(b.copies, b.offsets, strict=True)])
            steps.append(Step(f"{label}{b.index}", b.numel, ("recv", src), drain=drain, link=link))
    return steps


def broadcast_buckets(topo: Topology, budget_bytes: int) -> dict[int, list[Bucket]]:
    """Per stage, the buckets its source broadcasts (identical for every receiver)."""
    plan = topo.broadcast_plan
    out: dict[int, list[Bucket]] = {s: [] for s in range(topo.trainer.pp)}
    for b in make_buckets(plan, budget_bytes, plan.copies_to(0)):
        out[b.src].append(b)
    return out


def _gather_parts(gather: Plan, bucket: Bucket) -> list[tuple[int, Copy, int, tuple, tuple]]:
    """(src trainer rank, gather copy, bucket copy index, overlap offsets, overlap sizes)."""
    by_logical: dict[str, list[int]] = {}
    for i, c in enumerate(bucket.copies):
        by_logical.setdefault(c.logical, []).append(i)
    out = []
    for g in gather.copies:
        for i in by_logical.get(g.logical, ()):
            bc = bucket.copies[i]
            ov = box_overlap(g.logical_offsets, g.sizes, bc.logical_offsets, bc.sizes)
            if ov is not None:
                out.append((g.src, g, i, ov[0], ov[1]))
    return out


@functools.lru_cache(maxsize=16)
def broadcast_steps(topo: Topology, me: int, budget_bytes: int, stage: int) -> tuple[Step, ...]:
    """Steps of sync rank ``me`` for one stage of the broadcast path (gather, then broadcast)."""
    ranks = SyncRanks(topo)
    group = f"stage{stage}"
    source = topo.stage_ranks(stage)[0]
    gather = topo.gather_plan
    engine_rank = me - ranks.trainer_world
    narrow: dict[str, list[Copy]] | None = None
    if engine_rank >= 0:
        engine = next(i for i in range(len(topo.engines))
                      if topo.engine_rank_offset(i) <= engine_rank < topo.engine_rank_offset(i + 1))
        local_rank = engine_rank - topo.engine_rank_offset(engine)
        narrow = {}
        for c in topo.narrow_plan(engine).copies_to(local_rank):
            narrow.setdefault(c.logical, []).append(c)
    steps: list[Step] = []
    for b in broadcast_buckets(topo, budget_bytes)[stage]:
        parts = _gather_parts(gather, b)
        label = f"bcast{stage}.{b.index}"
        raw = topo.broadcast_plan.raw
        keys = tuple((f"c{i}", off, c.sizes, raw.get(c.logical))
                     for i, (c, off) in enumerate(zip(b.copies, b.offsets, strict=True)))
        # Gather sends from the stage's other TP ranks, one message per peer, in peer order.
        peers = sorted({p[0] for p in parts if p[0] != source})
        fills = []
        for peer in peers:
            mine = [p for p in parts if p[0] == peer]
            send, recv, pos = [], [], 0
            for _, g, i, ov_off, ov_size in mine:
                src_off = tuple(so + d for so, d in zip(g.src_offsets, _rel(ov_off, g.logical_offsets), strict=True))
                own = raw.get(g.logical)
                w = width(own, topo.wire_dtype)
                pos = -(-pos // w) * w  # a raw span starts on a whole element of its dtype
                send.append(Binding(g.src_local, _region(src_off, ov_size), pos, ov_size, full_region(ov_size),
                                    raw=own))
                recv.append(Binding(f"c{i}", _region(_rel(ov_off, b.copies[i].logical_offsets), ov_size),
                                    pos, ov_size, full_region(ov_size), space="main", raw=own))
                pos += _prod(ov_size) * w
            if me == peer:
                steps.append(Step(f"gather{stage}.{b.index}", pos, ("send", source), pack=tuple(send),
                                  link=f"tp->source{stage}"))
            fills.append(SubRecv(peer, pos, tuple(recv)))
        if me == source:
            pack = []
            for _, g, i, ov_off, ov_size in (p for p in parts if p[0] == source):
                src_off = tuple(so + d for so, d in zip(g.src_offsets, _rel(ov_off, g.logical_offsets), strict=True))
                bc = b.copies[i]
                pack.append(Binding(g.src_local, _region(src_off, ov_size), b.offsets[i], bc.sizes,
                                    _region(_rel(ov_off, bc.logical_offsets), ov_size), raw=raw.get(bc.logical)))
            steps.append(Step(label, b.numel, ("bcast", group, 0, True), pack=tuple(pack),
                              fill=tuple(fills), main_views=keys, link=f"source{stage}->all"))
        elif narrow is not None:
            drain = []
            for bc, off in zip(b.copies, b.offsets, strict=True):
                for n in narrow.get(bc.logical, ()):
                    # in logical coordinates: a whole tensor's local ones differ where it holds
                    # an FP8 weight's cells (quant.wire)
                    ov = box_overlap(n.logical_offsets, n.sizes, bc.logical_offsets, bc.sizes)
                    if ov is None:
                        continue
                    dst_off = tuple(d + x for d, x in zip(n.dst_offsets, _rel(ov[0], n.logical_offsets), strict=True))
                    drain.append(Binding(n.dst_local, _region(dst_off, ov[1]), off, bc.sizes,
                                         _region(_rel(ov[0], bc.logical_offsets), ov[1]), raw=raw.get(bc.logical)))
            steps.append(Step(label, b.numel, ("bcast", group, 0, False), drain=tuple(drain),
                              link=f"source{stage}->all"))
    return tuple(steps)  # cached (lru_cache): shared, never mutated


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def subgroups(topo: Topology) -> dict[str, list[int]]:
    """The sync group's named subgroups (every member builds the same ones, in this order)."""
    ranks = SyncRanks(topo)
    return {f"stage{s}": ranks.stage_group(s) for s in range(topo.trainer.pp)}


def write_order(steps: Sequence[Step]) -> list[str]:
    """Local tensors in the order a rank's steps first write them (a staging window is the
    first ones: the receive reaches the rest last)."""
    seen: dict[str, None] = {}
    for s in steps:
        for b in s.drain:
            if b.space == "local":
                seen.setdefault(b.key)
    return list(seen)
