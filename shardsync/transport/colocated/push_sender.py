"""The trainer's end of the push path: it writes each engine rank's staging copy itself, so
the copies start when ``update()`` is called instead of after the engine woke up, checked the
begin and ran its receive (~0.7 ms on the H200 host, the whole gap of the map path to its
copy limit).  It maps the engine's staging sets and fence, and writes the set the engine
named once the engine is done with every earlier update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch

from shardsync.plan.runs import Run, compile_runs
from shardsync.runtime.stats import Stats
from shardsync.transport import events
from shardsync.transport.colocated.exports import Exports, addresses
from shardsync.transport.colocated.link import ABORT, TrainerLink, judged, signal
from shardsync.transport.colocated.share import Share
from shardsync.transport.copies import Copies, SideStreams
from shardsync.transport.handles import open_set

# (number, local, peer -> set, error, seconds) of one ``launch``
Launched = tuple[int, Mapping[str, torch.Tensor], dict[int, int], Exception | None, float]


class Producer(Protocol):
    """Makes some of the local tensors the runs read (an FP8 engine's e4m3 words and scales,
    ``runtime.quantizer``) and can write them straight into a staging set instead."""

    def produce_into(self, runs: Sequence[Run], dst: Mapping[str, torch.Tensor]) -> tuple[Callable[[], None] | None,
                                                                                          list[Run]]:
        """A launch writing what some of ``runs`` copy into ``dst`` (None: none), and the runs
        left to copy."""
        ...


# per staging set: the producer's launch, the copies from the largest tensor, from the rest
Pushes = tuple[Callable[[], None] | None, tuple[Copies, ...]]


class PushSender:
    """A trainer rank's end of the push path (same contract as ``MapSender``).

    Which set the next update writes is the engine's word: after every commit or refusal it
    posts a numbered record ``[set]`` (``TrainerLink.staged``), and this rank writes update
    ``n`` only after it read the record numbered ``n``, so the set it names is not the one
    served.  Its stream waits on the engine's commit fence (steps queued before the commit no
    longer read that set), copies, records its own event and signals ``[generation, stream,
    set]``; the engine's commit orders what it serves next after that event on the GPU.
    """

    def __init__(self, share: Share, *, stream: bool = True, mailbox: bool = True,
                 producer: Producer | None = None) -> None:
        self.share, self.stream, self.producer = share, stream, producer
        self.links = [TrainerLink(share, p, mailbox) for p in share.peers]
        self.exports = Exports(share, offers=False)  # the engine maps none of its tensors: it copies
        self.number = 0  # updates signalled
        self.parts: tuple[list[str], list[str]] = ([], [])  # the largest exported tensor, the rest
        self._part_addresses: tuple[list[int], list[int]] | None = None
        self._opened = events.Opened()  # the engines' commit fences
        self._targets: dict[int, tuple[list[dict[str, torch.Tensor]], torch.cuda.Event | None]] = {}
        self._runs: dict[int, list[Run]] = {}
        self._pushes: dict[int, tuple[object, list[Pushes]]] = {}  # peer -> (local, per set)
        self._streams = SideStreams()
        self._launched: Launched | None = None

    def export(self, local: Mapping[str, torch.Tensor]) -> None:
        """Publish this rank's event (and, the first time, the mailboxes); the copies compile
        again from where the tensors are now."""
        self.exports.export(local, self.links)
        self._pushes.clear()  # tensors moved (or first export): compile the copies from where they are
        names = list(self.exports.exported)
        lead = max(names, key=lambda n: local[n].numel() * local[n].element_size(), default=None)
        self.parts = ([n for n in names if n == lead], [n for n in names if n != lead])
        self._part_addresses = None if self.exports.addresses is None else (
            addresses(local, self.parts[0]), addresses(local, self.parts[1]))

    def _part_moved(self, local: Mapping[str, torch.Tensor], part: int) -> bool:
        """Whether a tensor of ``part`` (0: the largest, 1: the rest) moved since export."""
        names = self.parts[part]
        if self._part_addresses is not None:  # device tensors: the address is the identity
            return addresses(local, names) != self._part_addresses[part]
        return bool(self.exports.moved_of(local, names))

    def _export_moved(self, local: Mapping[str, torch.Tensor]) -> None:
        if self.exports.stale(local):
            self.export(local)

    def _target(self, peer: int) -> tuple[list[dict[str, torch.Tensor]], torch.cuda.Event | None]:
        """``peer``'s staging sets and commit fence, mapped at the first update."""
        hit = self._targets.get(peer)
        if hit is None:
            key = self.share.keys.staging(peer, self.share.rank)
            self.share.wait(key)
            tensors, fence, _ = open_set(self.share.get(key), where=f"store key {key}")
            sets: list[dict[str, torch.Tensor]] = []
            for name, t in tensors.items():
                index, _, local = name.partition("/")
                if not index.isdigit() or int(index) > len(sets) or not local:
                    raise ValueError(f"store key {key} names {name!r}, not '<set>/<tensor>' in set order")
                if int(index) == len(sets):
                    sets.append({})
                sets[int(index)][local] = t
            hit = self._targets[peer] = (sets, None if fence is None else self._opened.of_handle(fence))
        return hit

    def _push_copies(self, peer: int, local: Mapping[str, torch.Tensor]) -> list[Pushes]:
        """Per staging set: what the producer writes itself, then the copies from the largest
        tensor and from the rest (two launches)."""
        hit = self._pushes.get(peer)
        if hit is None or hit[0] is not local:
            if peer not in self._runs:
                self._runs[peer] = self.share.runs(peer)
            lead = set(self.parts[0])
            sets, _ = self._target(peer)
            pushes: list[Pushes] = []
            for s in sets:
                made, runs = (None, self._runs[peer]) if self.producer is None else \
                    self.producer.produce_into(self._runs[peer], s)
                parts = ([r for r in runs if r.first.src_local in lead],
                         [r for r in runs if r.first.src_local not in lead])
                pushes.append((made, tuple(Copies.of(compile_runs(p, local, s)) for p in parts)))
            hit = self._pushes[peer] = (local, pushes)
        return hit[1]

    def _copy(self, peer: int, local: Mapping[str, torch.Tensor], index: int, parts: tuple[int, ...],
              fenced: bool) -> None:
        """Queue ``parts`` of the copies into ``peer``'s set ``index`` (``fenced``: first wait
        until the engine's steps stopped reading that set)."""
        made, copies = self._push_copies(peer, local)[index]
        made = made if 0 in parts else None  # the producer writes with the first part
        device = next((c.device for c in copies if c.device is not None), None)
        if device is None and made is not None:
            device = self.exports.device
        if device is None or device.type != "cuda":
            if made is not None:
                made()
            for p in parts:
                copies[p].run()
            return
        mine = self.exports.device if self.exports.device is not None and self.exports.device != device else None
        if mine is not None:  # the copies run on the engine's device: after our writes
            torch.cuda.current_stream(device).wait_stream(torch.cuda.current_stream(mine))
        fence = self._target(peer)[1]
        if fenced and fence is not None and not fence.query():
            torch.cuda.current_stream(device).wait_event(fence)
        if made is not None:
            with torch.cuda.device(device):
                made()  # on the device's current stream, after the fence
        for p in parts:
            copies[p].run(self._streams.of(device))
        if mine is not None:
            torch.cuda.current_stream(mine).wait_stream(torch.cuda.current_stream(device))

    def launch(self, local: Mapping[str, torch.Tensor]) -> None:
        """Start this update's copies now, before the engines hear of it (``WeightSync.update``
        calls it ahead of the begin): the next ``run`` signals them.  Never raises: an error
        goes to the engines as an abort at ``run``.  Harmless if no ``run`` follows (a refused
        begin): only staging was written, and the next update writes the same set again.

        A copy never reads a tensor that moved since export, yet the check (~0.15-0.4 ms for a
        model's few hundred tensors on the H200 hosts) need not delay the first byte: the
        largest tensor is checked and copied first, the rest checked while it copies."""
        number, error = self.number + 1, None
        sets: dict[int, int] = {}
        t0 = time.perf_counter()
        try:
            if self._part_moved(local, 0):
                self._export_moved(local)  # and the copies compiled again from the new memory
            for link in self.links:
                sets[link.peer] = link.staged(number, len(self._push_copies(link.peer, local)))
                self._copy(link.peer, local, sets[link.peer], (0,), fenced=True)
            if self._part_moved(local, 1):  # the lead copies read unmoved memory: rewritten, same bytes
                self._export_moved(local)
                for peer in self.share.peers:
                    self._copy(peer, local, sets[peer], (0, 1), fenced=False)
            else:
                for peer in self.share.peers:
                    self._copy(peer, local, sets[peer], (1,), fenced=False)
            self.exports.mark_written()  # the engines' commits order their served streams after this
            if not self.stream and self.exports.device is not None:
                torch.cuda.current_stream(self.exports.device).synchronize()  # complete="host": the copies are done
        except Exception as e:
            error = e
        self._launched = (number, local, sets, error, time.perf_counter() - t0)

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats:
        stats = Stats()
        t0 = time.perf_counter()
        launched, self._launched = self._launched, None
        if launched is None or launched[0] != self.number + 1 or launched[1] is not local:
            self.launch(local)  # not launched ahead (or for another update): now
            launched, self._launched = self._launched, None
        assert launched is not None, "launch records its outcome (it never raises)"
        _, _, sets, error, pushed_s = launched
        header = [ABORT if error else self.exports.generation, int(self.stream and self.exports.device is not None)]
        self.number += 1
        pending = signal(self.links, self.number, header, {p: [sets.get(p, -1)] for p in self.share.peers})
        t1 = time.perf_counter()
        acks = [a() for a in pending]
        stats.pack_s = t1 - t0 + pushed_s  # the copies' launch (ahead of the begin or here) and the signal
        stats.transfer_s = time.perf_counter() - t1
        return judged(stats, acks, error, self.share)

    def detach(self) -> None:
        self._opened.clear()
        self._targets.clear()
        self._pushes.clear()
