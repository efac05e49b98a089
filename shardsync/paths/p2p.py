"""p2p: every trainer rank sends each engine rank exactly its plan copies (and relays, if
any), over the sync group, CUDA IPC slots, or - colocated - read in place by the engine or
written by the trainer into the engine's staging copy (push)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import torch

from shardsync.paths.base import Endpoint, Program, UpdateArgs
from shardsync.runtime.executor import BufferPool, Transport, execute
from shardsync.runtime.schedule import p2p_steps
from shardsync.runtime.stats import Stats
from shardsync.runtime.steps import Step
from shardsync.transport.colocated.map_receiver import MapReceiver
from shardsync.transport.colocated.map_sender import MapSender
from shardsync.transport.colocated.push_receiver import PushReceiver
from shardsync.transport.colocated.push_sender import PushSender
from shardsync.transport.colocated.share import Share
from shardsync.transport.group import SyncGroup
from shardsync.transport.ipc import IpcTransport
from shardsync.vocab import Ipc


class P2pProgram(Program):
    """Steps of one rank through the one executor (group or IPC slots as the transport)."""

    def __init__(self, ep: Endpoint, steps: Sequence[Step], transport: Transport,
                 slots: IpcTransport | None = None) -> None:
        self.ep, self.steps, self.transport, self.slots = ep, steps, transport, slots
        self.pool = BufferPool(ep.wire_dtype, ep.device)
        self.buckets = len(steps)

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        # shared GPU memory has no wire to corrupt: only messages through the group are checked
        stats = execute(self.steps, tensors, self.transport, pool=self.pool, credits=self.ep.credits,
                        detail=self.ep.detail, verify=self.ep.verify and self.slots is None)
        stats.buckets = self.buckets
        return stats

    def close(self) -> None:
        if self.slots is not None:
            self.slots.detach()  # unmap the trainer's slots


class _End(Protocol):
    """What every end of the colocated wing offers a program (``transport.colocated``)."""

    share: Share

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats: ...

    def detach(self) -> None: ...


End = TypeVar("End", bound=_End)


class ColocatedProgram(Program, Generic[End]):
    """Colocated: one end of the map or push path (``transport.colocated``).  One signal each
    way per update, so a refusal can be answered in place of the copies (``answers_refusals``:
    the trainer need not wait for the begin's answer first).

    ``buckets`` counts this rank's links (the engine ranks a trainer rank signals, the trainer
    ranks an engine rank hears from): a link's bytes move as one unit, one header and one ack,
    never cut into ``bucket_mb`` buckets as the two-sided paths cut theirs."""

    answers_refusals = True

    def __init__(self, end: End) -> None:
        self.end = end
        self.buckets = len(end.share.peers)

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        stats = self.end.run(tensors)
        stats.buckets = self.buckets
        return stats

    def close(self) -> None:
        self.end.detach()


class MapSendProgram(ColocatedProgram[MapSender]):
    """Trainer, map: the engines copy the plan's regions out of this rank's mapped tensors."""


class MapReceiveProgram(ColocatedProgram[MapReceiver]):
    """Engine, map: copies out of the trainers' mapped tensors; answers a refused update's signal."""

    def refuse(self) -> None:
        self.end.refuse()


class PushSendProgram(ColocatedProgram[PushSender]):
    """Trainer, push: writes the engines' staging copies before it signals (``launch``)."""

    overwrites = True  # the staging copy is written before the receive starts: nothing to catch up

    def launch(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Start the copies before the engines hear of the update (``run`` signals)."""
        self.end.launch(tensors)


class PushReceiveProgram(ColocatedProgram[PushReceiver]):
    """Engine, push: a receive only checks and acks; hears of each commit (the next set to write)."""

    overwrites = True

    def refuse(self) -> None:
        self.end.refuse()

    def committed(self) -> None:
        self.end.committed()


def _colocated(ep: Endpoint, group: SyncGroup) -> Program:
    """The end of the map or push path for this rank (trainer ranks send): trainer ranks
    export before engine ranks map (engines wait for the handles, bounded by the group timeout)."""
    co = ep.colocated
    assert co is not None, "only colocated endpoints compile a map or push end"
    push = co.ipc is Ipc.PUSH
    tensors = ep.tensors
    assert tensors is not None, "both ends of a colocated path build their Endpoint with their tensors"
    prefix = group.rdv.name
    if ep.is_trainer:
        share = Share.sender(group, ep.topo, prefix, ep.secret)
        if push:
            pusher = PushSender(share, stream=co.stream, mailbox=co.mailbox, producer=co.producer)
            pusher.export(tensors)
            return PushSendProgram(pusher)
        mapper = MapSender(share, stream=co.stream, mailbox=co.mailbox)
        mapper.export(tensors)
        return MapSendProgram(mapper)
    share = Share.receiver(group, ep.topo, prefix, ep.secret)
    if push:
        if co.staging is None:
            raise ValueError("ipc='push' needs the engine's staging copies (Colocated.staging)")
        receiver = PushReceiver(share, co.staging)
        for peer in share.peers:
            receiver.attach(peer, 1, tensors)
        return PushReceiveProgram(receiver)
    reader = MapReceiver(share)
    for peer in share.peers:
        reader.attach(peer, 1, tensors)
    return MapReceiveProgram(reader)


def compile_p2p(ep: Endpoint) -> Program:
    """Collective with the other end when ``ipc`` is set: trainer ranks export before engine
    ranks map (engines wait for the handles, bounded by the group timeout)."""
    if ep.group is None:
        raise ValueError("the p2p path needs a sync group")
    ipc = ep.colocated.ipc if ep.colocated is not None else None
    if ipc in (Ipc.MAP, Ipc.PUSH):
        return _colocated(ep, ep.group)
    steps = p2p_steps(ep.topo, ep.me, ep.bucket_bytes)
    if ipc is Ipc.SLOTS:
        slots = IpcTransport(ep.group, slots=ep.credits, secret=ep.secret)
        if ep.is_trainer:
            assert ep.tensors is not None, "a trainer rank builds its Endpoint with its tensors"
            device = next(iter(ep.tensors.values())).device
            for peer in sorted({s.comm[1] for s in steps if s.comm[0] == "send"}):
                numel = max(s.numel for s in steps if s.comm == ("send", peer))
                slots.export(peer, numel, ep.wire_dtype, device)
        else:
            for peer in sorted({s.comm[1] for s in steps if s.comm[0] == "recv"}):
                slots.attach(peer)
        return P2pProgram(ep, steps, slots, slots)
    return P2pProgram(ep, steps, ep.group)
