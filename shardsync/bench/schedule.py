"""One global order of control barriers and transfers, and each rank's part of it (pure).

Every rank runs the subsequence of one global order that concerns it: transfers run
through the runtime executor (oldest-first completion, so any credit window is
deadlock-free), and a rank drains its transfers before each control barrier it joins.
Per wave: ``go`` barriers (one per engine group), the groups' messages round-robin, then
``done`` barriers.  With a stride, a group's ``go`` sits just before its first message
and trainer ranks hold it until its offset has passed since the wave's first group
started (that group's ``go`` returned).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardsync.bench.policy import WavePlan
from shardsync.bench.topology import BenchLayout
from shardsync.bench.workload import Message, Workload
from shardsync.runtime.steps import Step


@dataclass(frozen=True)
class Go:
    """Barrier on ``ctrl{group}``: the group's update starts (after ``offset_s`` into the wave)."""

    group: int
    wave: int
    offset_s: float = 0.0


@dataclass(frozen=True)
class Done:
    """Barrier on ``ctrl{group}``: every rank of the group has received everything."""

    group: int


@dataclass(frozen=True)
class Xfer:
    msg: Message
    label: str


Op = Go | Done | Xfer
Item = Go | Done | tuple[Step, ...]


def effective_credits(credits: int, inflight_cap_bytes: int | None, max_message_bytes: int) -> int:
    """Buffers a rank may hold in flight: ``credits``, lowered so the bytes cap always holds.

    The executor counts buffers, so a bytes cap becomes a count using the largest message.
    """
    if credits < 1:
        raise ValueError(f"credits must be >= 1, got {credits}")
    if inflight_cap_bytes is None:
        return credits
    if inflight_cap_bytes < max_message_bytes:
        raise ValueError(f"in-flight cap {inflight_cap_bytes} B is below the largest message "
                         f"({max_message_bytes} B); raise --inflight-mb or lower --bucket-mb")
    return max(1, min(credits, inflight_cap_bytes // max(1, max_message_bytes)))


def global_order(waves: WavePlan, workload: Workload) -> list[Op]:
    """The order every rank follows; groups of a wave interleave message by message."""
    ops: list[Op] = []
    offsets = waves.offsets()
    for w, wave in enumerate(waves.waves):
        staggered = waves.stride_s > 0
        if not staggered:
            ops += [Go(g, w) for g in wave]
        rounds = max(1, max(len(workload.messages[g]) for g in wave))
        for k in range(rounds):
            for g in wave:
                if staggered and k == 0:
                    ops.append(Go(g, w, offsets[g]))
                if k < len(workload.messages[g]):
                    ops.append(Xfer(workload.messages[g][k], f"w{w}.g{g}.m{k}"))
        ops += [Done(g) for g in wave]
    return ops


def _step(x: Xfer, rank: int, layout: BenchLayout) -> Step | None:
    m = x.msg
    if m.dst is None:
        if rank == m.src or rank in layout.groups[m.group]:
            return Step(x.label, m.nbytes, ("bcast", f"data{m.group}", 0, rank == m.src), link=m.link)
        return None
    if rank == m.src:
        return Step(x.label, m.nbytes, ("send", m.dst), link=m.link)
    if rank == m.dst:
        return Step(x.label, m.nbytes, ("recv", m.src), link=m.link)
    return None


def rank_program(ops: Sequence[Op], rank: int, layout: BenchLayout) -> list[Item]:
    """``rank``'s barriers and runs of consecutive steps, in global order."""
    out: list[Item] = []
    run: list[Step] = []
    for op in ops:
        if isinstance(op, Xfer):
            step = _step(op, rank, layout)
            if step is not None:
                run.append(step)
        elif rank in layout.control_members(op.group):
            if run:
                out.append(tuple(run))
                run = []
            out.append(op)
    if run:
        out.append(tuple(run))
    return out
