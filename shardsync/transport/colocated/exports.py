"""What crosses a colocated link at connect: a trainer's exports (handle sets in the store, one
per engine rank and generation, with its written event and the link's mailbox; the identity
each tensor must keep and the per-update check that one moved) and an engine's mappings of
them.  A tensor that moved since export is exported again under the next generation and
mapped again before it is read, so a stale mapping is never read.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from shardsync.transport import events
from shardsync.transport.colocated.link import TrainerLink, proceeds
from shardsync.transport.colocated.share import Share
from shardsync.transport.events import EventHandle
from shardsync.transport.handles import OpenedSet, export_tensors, open_set
from shardsync.transport.pinning import HostPins

log = logging.getLogger(__name__)


def identity(t: torch.Tensor) -> tuple:
    """What an exported tensor must keep for the mapping to stay valid.

    CUDA: its address (torch keeps a block an importer still maps out of the allocator, so a
    reallocated tensor gets a new address).  CPU: also its shared-memory name, since a new
    allocation may land on the address a freed mapping had.
    """
    if t.is_cuda:
        return (t.data_ptr(),)
    if not t.is_shared():
        return (t.data_ptr(), None)
    try:
        return (t.data_ptr(), t.untyped_storage()._share_filename_cpu_()[1])
    except RuntimeError:  # shared by another mechanism (file descriptor): not our export
        return (t.data_ptr(), None)


_DATA_PTR = torch.Tensor.data_ptr


def addresses(local: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[int]:
    """The data addresses of ``names`` in ``local`` (~0.15-0.5 us a tensor: the per-update moved check)."""
    return list(map(_DATA_PTR, map(local.__getitem__, names)))


def _cuda_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    return next((t.device for t in tensors if t.is_cuda), None)


class Exports:
    """A trainer rank's exports: the tensors its copies read (``offers``: map) or none (push:
    the engine needs only the event and the mailbox), once per generation, one handle set per
    engine rank (each holds one reference), with the event recorded after its writes."""

    def __init__(self, share: Share, *, offers: bool) -> None:
        self.share, self.offers = share, offers
        self.generation = 0
        self.exported: dict[str, tuple] = {}  # name -> identity at the last export
        self.addresses: list[int] | None = None  # every exported tensor's address (all CUDA): the fast check
        self.shm_names: set[str] = set()  # of exported CPU storages
        self.written: torch.cuda.Event | None = None  # recorded after this rank's writes
        self.device: torch.device | None = None  # where the exported tensors live (None: host)

    def export(self, local: Mapping[str, torch.Tensor], links: Sequence[TrainerLink]) -> None:
        """Publish handles of the tensors this rank's copies read (generation bumps per call);
        the first generation carries each link's mailbox."""
        names = sorted({c.src_local for c in self.share.copies})
        tensors = {n: local[n] for n in names}
        shapes = self.share.shapes
        wrong = [f"{n} {tuple(t.shape)} (plan: {shapes[n]})" for n, t in tensors.items()
                 if n in shapes and tuple(t.shape) != shapes[n]]
        if wrong:  # copies would run out of bounds: refuse before anything is published
            raise ValueError(f"tensor(s) changed shape since connect: {', '.join(wrong[:3])}; "
                             "restore the shapes or reconnect with the new model")
        self.generation += 1
        self.device = _cuda_device(tensors.values())
        written = None
        if self.device is not None:
            if self.written is None:
                self.written = events.new_event()
            self.written.record(torch.cuda.current_stream(self.device))  # creates it on that device
            written = events.handle_of(self.written, self.device)
        offered = tensors if self.offers else {}
        for link in links:  # one handle set per reader: each holds one reference
            key = self.share.keys.mapped(self.share.rank, link.peer, self.generation)
            box = link.offer() if self.generation == 1 else None  # the first set carries it
            self.share.put(key, export_tensors(offered, written, box))
            if box is not None:
                link.hold(box)  # exporting moved it into shared memory
                self.shm_names.add(identity(box)[1].decode())
        self.exported = {n: identity(t) for n, t in tensors.items()}
        self.addresses = [t.data_ptr() for t in tensors.values()] if all(t.is_cuda for t in tensors.values()) \
            else None
        # shared-memory names (CPU): torch removes them when the last process unmaps
        self.shm_names.update(i[1].decode() for i in self.exported.values() if len(i) == 2 and i[1])

    def moved(self, local: Mapping[str, torch.Tensor]) -> list[str]:
        """The exported tensors that moved since the last export."""
        if self.addresses is not None and addresses(local, self.exported) == self.addresses:
            return []  # device tensors: an address is the whole identity (one list compare per update)
        return self.moved_of(local, self.exported)

    def moved_of(self, local: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[str]:
        """Those of ``names`` whose identity changed since export (host tensors: the shm name too)."""
        return [k for k in names if identity(local[k]) != self.exported[k]]

    def stale(self, local: Mapping[str, torch.Tensor]) -> bool:
        """Whether a tensor moved since the last export: the sender exports again before anyone reads."""
        moved = self.moved(local)
        if moved:
            log.info("rank %d: %d exported tensor(s) moved since export (e.g. %s): exporting them again",
                     self.share.rank, len(moved), moved[0])
        return bool(moved)

    def mark_written(self) -> None:
        """Where the engines' reads start (this rank's stream's writes before this point)."""
        if self.written is not None and self.device is not None:  # host tensors: nothing queued
            self.written.record(torch.cuda.current_stream(self.device))


class Mapped:
    """An engine rank's mappings of its trainers' exports: per trainer, the generation mapped,
    its tensors (host storages page-locked here for copies into a GPU) and its written event."""

    def __init__(self, share: Share) -> None:
        self.share = share
        self.sets: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # peer -> (generation, tensors)
        self.written: dict[int, torch.cuda.Event] = {}  # peer -> its event, recorded after its writes
        self.events = events.Opened()
        self._pins: dict[int, HostPins] = {}  # peer -> its CPU storages, page-locked here for H2D copies

    def current(self, peer: int, generation: int) -> bool:
        return self.sets.get(peer, (None,))[0] == generation

    def proceed(self, peer: int, generation: int, error: Exception | None,
                attach: Callable[[int, int], None]) -> bool:
        """Whether ``peer``'s part of a receive goes on (no earlier error, no abort), with its
        set of ``generation`` mapped (``attach`` maps a set this rank has not seen yet)."""
        if not proceeds(peer, generation, error):
            return False
        if not self.current(peer, generation):
            attach(peer, generation)
        return True

    def wait(self, peer: int, generation: int) -> str:
        """The store key of ``peer``'s set of ``generation``, once it is there."""
        key = self.share.keys.mapped(peer, self.share.rank, generation)
        self.share.wait(key)
        return key

    def open(self, peer: int, key: str) -> OpenedSet:
        """Open the set at ``key``; ``peer``'s old mapping is released before the new one opens."""
        self.sets.pop(peer, None)
        self._pins.pop(peer, HostPins()).release()
        return open_set(self.share.get(key), where=f"store key {key}", read_only=True)  # the engine only reads

    def hold(self, peer: int, generation: int, tensors: dict[str, torch.Tensor], written: EventHandle | None,
             *, pin: bool) -> None:
        """Keep ``peer``'s opened set as its current mapping (``pin``: copies read it into a GPU)."""
        self.written.pop(peer, None)
        if written is not None:
            self.written[peer] = self.events.of_handle(written)
        if pin:
            self._pins[peer] = HostPins()
            self._pins[peer].pin(tensors.values(), read_only=True)
        self.sets[peer] = (generation, tensors)

    def release(self) -> None:
        self.written.clear()
        self.events.clear()
        for pins in self._pins.values():
            pins.release()
        self._pins.clear()
        self.sets.clear()
