"""p2p: every trainer rank sends each engine rank exactly its plan copies (and relays, if
any), over the sync group, CUDA IPC slots, or - colocated - read in place by the engine or
written by the trainer into the engine's staging copy (push)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.paths.base import Endpoint, Program, UpdateArgs
from shardsync.runtime.executor import BufferPool, Transport, execute
from shardsync.runtime.schedule import p2p_steps
from shardsync.runtime.stats import Stats
from shardsync.runtime.steps import Step
from shardsync.transport.ipc import IpcTransport
from shardsync.transport.mapped import MappedTransport
from shardsync.transport.pushed import PushedTransport


class P2pProgram(Program):
    """Steps of one rank through the one executor (group or IPC slots as the transport)."""

    def __init__(self, ep: Endpoint, steps: list[Step], transport: Transport,
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


class MappedProgram(Program):
    """Colocated: the engine copies the plan's regions out of the trainer's mapped tensors.
    One signal each way per update, so a refusal can be answered in place of the copies
    (``answers_refusals``: the trainer need not wait for the begin's answer first)."""

    answers_refusals = True

    def __init__(self, ep: Endpoint, mapped: MappedTransport, buckets: int) -> None:
        self.mapped, self.buckets = mapped, buckets

    def refuse(self) -> None:
        self.mapped.refuse()

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        stats = self.mapped.run(tensors)
        stats.buckets = self.buckets
        return stats

    def close(self) -> None:
        self.mapped.detach()


class PushedProgram(MappedProgram):
    """Colocated, push: the trainer writes the engine's staging copy before it signals, so a
    receive only checks and acks; the receiver hears of each commit (the next set to write)."""

    overwrites = True  # the staging copy is written before the receive starts: nothing to catch up
    mapped: PushedTransport

    def __init__(self, ep: Endpoint, mapped: PushedTransport, buckets: int) -> None:
        super().__init__(ep, mapped, buckets)

    def launch(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Trainer: start the copies before the engines hear of the update (``run`` signals)."""
        self.mapped.launch(tensors)

    def committed(self) -> None:
        self.mapped.committed()


def compile_p2p(ep: Endpoint) -> Program:
    """Collective with the other end when ``ipc`` is set: trainer ranks export before engine
    ranks map (engines wait for the handles, bounded by the group timeout)."""
    if ep.group is None:
        raise ValueError("the p2p path needs a sync group")
    steps = p2p_steps(ep.topo, ep.me, ep.bucket_bytes)
    if ep.ipc in ("map", "push"):
        push = ep.ipc == "push"
        if push and not ep.is_trainer and ep.staging is None:
            raise ValueError("ipc='push' needs the engine's staging copies (Endpoint.staging)")
        program: MappedProgram
        if push:
            pushed = PushedTransport.for_rank(ep.group, ep.topo, ep.group.rdv.name, ep.secret, stream=ep.ipc_stream,
                                              mailbox=ep.ipc_mailbox, staging=ep.staging)
            program = PushedProgram(ep, pushed, len(steps))
        else:
            mapped = MappedTransport.for_rank(ep.group, ep.topo, ep.group.rdv.name, ep.secret, stream=ep.ipc_stream,
                                              mailbox=ep.ipc_mailbox)
            program = MappedProgram(ep, mapped, len(steps))
        tensors = ep.tensors
        assert tensors is not None, "both ends of a colocated path build their Endpoint with their tensors"
        if ep.is_trainer:
            program.mapped.export(tensors)
        else:
            for peer in program.mapped.peers:
                program.mapped.attach(peer, 1, tensors)
        return program
    if ep.ipc == "slots":
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
    if ep.ipc:
        raise ValueError(f"ipc must be 'map', 'slots' or 'push', got {ep.ipc!r}")
    return P2pProgram(ep, steps, ep.group)
