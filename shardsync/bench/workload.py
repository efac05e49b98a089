"""What each engine group receives: synthetic messages, or the buckets of a real plan (pure).

Only sizes matter to the bench: it moves zero-filled buffers of the planned sizes, so a
plan workload moves exactly a plan's bytes without building any model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from shardsync.bench.topology import BenchLayout
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.plan import make_buckets
from shardsync.presets import load_spec
from shardsync.runtime.schedule import broadcast_buckets
from shardsync.topology import Topology

TRANSPORTS = ("broadcast", "p2p")


@dataclass(frozen=True)
class Message:
    """``nbytes`` from bench rank ``src`` to rank ``dst``, or to all of ``group`` when None."""

    group: int
    src: int
    dst: int | None
    nbytes: int
    link: str = ""


@dataclass(frozen=True)
class Workload:
    name: str
    transport: str
    messages: tuple[tuple[Message, ...], ...]  # per engine group, in send order
    group_sizes: tuple[int, ...]

    def delivered_bytes(self, group: int) -> int:
        """Bytes that land on the group's ranks (a broadcast lands on each of them)."""
        return sum(m.nbytes if m.dst is not None else m.nbytes * self.group_sizes[group]
                   for m in self.messages[group])

    @property
    def total_delivered_bytes(self) -> int:
        return sum(self.delivered_bytes(g) for g in range(len(self.messages)))

    @property
    def max_message_bytes(self) -> int:
        return max((m.nbytes for ms in self.messages for m in ms), default=0)

    def describe(self) -> dict:
        return {"name": self.name, "transport": self.transport,
                "messages_per_group": [len(m) for m in self.messages],
                "delivered_bytes_per_group": [self.delivered_bytes(g) for g in range(len(self.messages))],
                "max_message_bytes": self.max_message_bytes}


def _check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")


def synthetic(layout: BenchLayout, transport: str, *, nbytes: int, count: int) -> Workload:
    """``count`` messages of ``nbytes`` for every engine rank, from the group's sender.

    p2p sends each rank its own copy (rank by rank, message by message); broadcast sends
    each message once to the whole group.  Either way every engine rank receives
    ``count * nbytes``.
    """
    _check_transport(transport)
    if nbytes < 1 or count < 1:
        raise ValueError(f"synthetic messages need a size >= 1 B and a count >= 1, got {nbytes} B x {count}")
    per_group = []
    for g, ranks in enumerate(layout.groups):
        src = layout.sender(g)
        if transport == "broadcast":
            msgs = [Message(g, src, None, nbytes, f"{src}->group{g}") for _ in range(count)]
        else:
            msgs = [Message(g, src, r, nbytes, f"{src}->{r}") for _ in range(count) for r in ranks]
        per_group.append(tuple(msgs))
    return Workload(f"synthetic {count} x {nbytes} B", transport, tuple(per_group),
                    tuple(len(g) for g in layout.groups))


@cache
def plan_topology(model: str, trainer_tp: int, engine_tp: int) -> Topology:
    """The sync topology of one engine group (cached: plans are built once per shape)."""
    return Topology(load_spec(model), MegatronParallel(tp=trainer_tp), (EngineParallel(tp=engine_tp),))


def from_plan(layout: BenchLayout, transport: str, *, model: str, trainer_tp: int,
              engine_tp: int | None, bucket_bytes: int) -> Workload:
    """The buckets a real sync moves into each engine group, as message sizes.

    Every engine group is one engine of TP ``engine_tp`` (its size); p2p moves the
    shard-to-shard plan's buckets, plan trainer rank ``s`` sending from bench trainer rank
    ``s % T``; broadcast moves the stage source's buckets from the group's sender.  The
    trainer's TP gather that precedes a real broadcast is not part of the bench.
    """
    _check_transport(transport)
    if trainer_tp < 1:
        raise ValueError(f"--trainer-tp must be >= 1, got {trainer_tp}")
    trainers = layout.trainers
    per_group = []
    for g, ranks in enumerate(layout.groups):
        tp = engine_tp if engine_tp is not None else len(ranks)
        if tp != len(ranks):
            raise ValueError(f"engine group {g} has {len(ranks)} rank(s) but --engine-tp is {tp}; "
                             f"use groups of {tp} ranks or leave --engine-tp out")
        topo = plan_topology(model, trainer_tp, tp)
        if transport == "p2p":
            plan = topo.p2p_plan
            buckets = sorted(make_buckets(plan, bucket_bytes), key=lambda b: (b.index, b.src, b.dst))
            msgs = tuple(Message(g, trainers[b.src % len(trainers)], ranks[b.dst], b.numel * plan.itemsize,
                                 f"{plan.src.ranks[b.src].label}->{plan.dst.ranks[b.dst].label}")
                         for b in buckets)
        else:
            itemsize = topo.broadcast_plan.itemsize
            src = layout.sender(g)
            msgs = tuple(Message(g, src, None, b.numel * itemsize, f"source0->group{g}")
                         for b in broadcast_buckets(topo, bucket_bytes)[0])
        per_group.append(msgs)
    name = f"plan {model} trainer TP{trainer_tp} -> engine TP {sorted({len(r) for r in layout.groups})}"
    return Workload(name, transport, tuple(per_group), tuple(len(g) for g in layout.groups))
