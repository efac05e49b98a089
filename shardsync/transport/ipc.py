"""CUDA IPC transport for engines that share a GPU with a trainer rank (colocated); on CPU
the same slots live in shared memory (how the CPU tests run it), host order standing in for
the events.

The sender owns ``slots`` preallocated device buffers per link, exported once through the
rendezvous store; the receiver maps them once.  A message is: copy in, record the slot's
CUDA IPC event, signal ``[slot, numel, event]`` over the sync group (gloo, CPU); the
receiver's stream waits on that event, copies out, records its own event for the slot and
acks ``[slot, event]``; before the sender writes the slot again its stream waits on the
receiver's event.  No CPU waits for a copy (the receiver synchronizes once, at the end of
the update), and no buffer is rewritten before its reader finished on the GPU.  Same plans,
steps and executor as every other transport: this class only replaces ``send`` and ``recv``.
"""

from __future__ import annotations

import torch

from shardsync.runtime.executor import Pooled
from shardsync.store.keys import Keys
from shardsync.store.sealed import seal, unseal
from shardsync.transport import events
from shardsync.transport.group import SyncGroup
from shardsync.transport.handles import export_tensors, open_tensors

_NO_EVENT = [0] * events.WORDS  # a signal's event words between host buffers


class _Done:
    def wait(self) -> None:
        return None


class _Pending:
    def __init__(self, work) -> None:
        self._work = work

    def wait(self) -> None:
        self._work.wait()


class IpcTransport(Pooled):
    """Wraps a ``SyncGroup``: point-to-point data through shared device memory.

    Collective contract: senders call ``export(peer, ...)`` for each receiver before the
    receivers call ``attach(peer)``; both sides then run the same steps in the same order.
    """

    def __init__(self, group: SyncGroup, *, slots: int = 2, secret: str) -> None:
        self.group, self.nslots, self.secret = group, slots, secret
        self.rank = group.rank
        self._out: dict[int, list[torch.Tensor]] = {}
        self._in: dict[int, list[torch.Tensor]] = {}
        self._next: dict[int, int] = {}
        self._acks: dict[tuple[int, int], _AckWait] = {}
        self._events: dict[tuple[int, int], tuple[torch.cuda.Event, list[int]]] = {}  # (peer, slot): ours
        self._opened = events.Opened()  # the other side's events, by their words
        self._device: torch.device | None = None  # receiver: where it unpacked (synchronized at the end)
        self.copy_bytes = 0

    # -- setup --

    def export(self, peer: int, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate this link's slots on our GPU and publish their IPC handles."""
        bufs = [torch.empty(numel, dtype=dtype, device=device) for _ in range(self.nslots)]
        self._out[peer] = bufs
        self._next[peer] = 0
        key = Keys(self.group.rdv.name).slots(self.rank, peer)
        self.group.store.set(key, seal(key, export_tensors({str(i): b for i, b in enumerate(bufs)}), self.secret))

    def attach(self, peer: int) -> None:
        """Map the slots ``peer`` exported for us (same GPU)."""
        key = Keys(self.group.rdv.name).slots(peer, self.rank)
        self.group.store.wait([key], self.group.rdv.timeout)
        slots = open_tensors(unseal(key, self.group.store.get(key), self.secret), where=f"store key {key}")
        self._in[peer] = [slots[str(i)] for i in range(len(slots))]
        self._next[peer] = 0

    def detach(self) -> None:
        """Unmap the peers' slots (the engine leaves the sync group)."""
        self._in.clear()
        self._opened.clear()

    # -- buffers the executor packs into / unpacks from directly (two copies per byte) --

    def lend(self, kind: str, peer: int, numel: int) -> torch.Tensor | None:
        """Receivers unpack straight from the next slot of the link.  Senders get None: they
        pack (or send whole tensors) as usual and ``send`` copies in, so packing the next
        bucket overlaps the receiver reading the previous one (lending the slot to the
        sender would make it wait for the ack before packing; measured slower)."""
        if kind == "send":
            return None
        return self._in[peer][self._next[peer]][:numel]

    def give_back(self, kind: str, peer: int, buf: torch.Tensor) -> None:
        """A received slot was unpacked (queued): tell its owner it may write it after our event."""
        if kind == "recv":
            k = next(i for i, s in enumerate(self._in[peer]) if s.data_ptr() == buf.data_ptr())
            self._release(peer, k, buf.device)

    def _mark(self, peer: int, k: int, device: torch.device) -> list[int]:
        """Record this side's event of slot ``k`` on the current stream; its words for the signal
        (host memory: zeros, the copy is done when it returns)."""
        if device.type != "cuda":
            return _NO_EVENT
        hit = self._events.get((peer, k))
        if hit is None:
            ev = events.new_event()
            ev.record(torch.cuda.current_stream(device))  # creates it on that device: its handle exists
            hit = self._events[(peer, k)] = (ev, events.words(ev, device))
        else:
            hit[0].record(torch.cuda.current_stream(device))
        return hit[1]

    def _release(self, peer: int, k: int, device: torch.device) -> None:
        self._device = device
        self.group.send(torch.tensor([k, *self._mark(peer, k, device)], dtype=torch.int64), peer).wait()

    def _after(self, values: list[int], device: torch.device) -> None:
        """The current stream's later work waits for the other side's event (given by its words)."""
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self._opened.of_words(values))

    # -- Transport --

    def send(self, buf: torch.Tensor, peer: int) -> _Pending:
        k = self._next[peer]
        self._next[peer] = (k + 1) % self.nslots
        slot = self._out[peer][k]
        ack = self._acks.pop((peer, k), None)
        if ack is not None:  # the receiver's copies out of this slot go first, on the GPU
            self._after(ack.wait(), slot.device)
        if buf.data_ptr() != slot.data_ptr():  # not packed in place: copy in
            slot[:buf.numel()].copy_(buf)
        self.copy_bytes += buf.numel() * buf.element_size()
        header = torch.tensor([k, buf.numel(), *self._mark(peer, k, slot.device)], dtype=torch.int64)
        self._acks[(peer, k)] = _AckWait(self.group, peer, k)
        return _Pending(self.group.send(header, peer))

    def recv(self, buf: torch.Tensor, peer: int) -> _Done:
        expected = self._next[peer]
        self._next[peer] = (expected + 1) % self.nslots
        header = torch.zeros(2 + events.WORDS, dtype=torch.int64)
        self.group.recv(header, peer).wait()
        k, n, *written = header.tolist()
        if n != buf.numel() or k != expected:
            raise RuntimeError(f"IPC message (slot {k}, {n} elements) for step (slot {expected}, "
                               f"{buf.numel()} elements): sender and receiver disagree on the plan")
        slot = self._in[peer][k]
        self._after(written, slot.device)  # the sender's copy into the slot landed
        if buf.data_ptr() != slot.data_ptr():  # not lent: copy out and release now
            buf.copy_(slot[:n])
            self._release(peer, k, buf.device)
        return _Done()

    def broadcast(self, buf: torch.Tensor, group: str, root: int):
        return self.group.broadcast(buf, group, root)

    def synchronize(self) -> None:
        for (peer, k), ack in self._acks.items():  # the next update's copies in wait for these reads
            self._after(ack.wait(), self._out[peer][k].device)
        self._acks.clear()
        if self._device is not None and self._device.type == "cuda":  # receiver: copies out done before commit
            torch.cuda.current_stream(self._device).synchronize()
            self._device = None
        self.group.synchronize()

    def barrier(self) -> None:
        self.group.barrier()


class _AckWait:
    """The receiver's release of one slot, received lazily (when the slot is reused)."""

    def __init__(self, group: SyncGroup, peer: int, slot: int) -> None:
        self._t = torch.zeros(1 + events.WORDS, dtype=torch.int64)
        self._work = group.recv(self._t, peer)
        self._slot = slot

    def wait(self) -> list[int]:
        """The receiver's event words for the slot (its copies out end there)."""
        self._work.wait()
        k, *done = self._t.tolist()
        if k != self._slot:
            raise RuntimeError(f"IPC ack for slot {k}, expected {self._slot}")
        return done
