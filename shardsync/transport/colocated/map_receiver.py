"""The engine's end of the map path: it maps each trainer rank's exported tensors once and
compiles its copies out of them, and each update copies after the trainer's writes and acks.
Between GPUs both marks are CUDA IPC events, so the copies wait on the trainer's event and,
with ``stream``, the trainer on the engine's, neither CPU waiting for the copy.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from shardsync.plan.runs import Run, compile_runs
from shardsync.runtime.gated import Gated, ungated, window_of
from shardsync.runtime.stats import Stats, StepTiming
from shardsync.transport import events
from shardsync.transport.colocated.exports import Mapped
from shardsync.transport.colocated.link import FAILED, QUEUED, READY, EngineLink
from shardsync.transport.colocated.share import Share
from shardsync.transport.copies import Copies, SideStreams

HEADER_WORDS = 2  # generation, stream


class MapReceiver:
    """An engine rank's end of the map path: it copies its share of the p2p plan out of the
    trainers' mapped tensors into its own, as (destination view, mapped source view) pairs,
    strided where a per-group pattern allows (``plan.runs``)."""

    def __init__(self, share: Share) -> None:
        self.share = share
        self.links = {p: EngineLink(share, p) for p in share.peers}
        self.mapped = Mapped(share)
        self._runs: dict[int, list[Run]] = {}
        self._copies: dict[int, dict[int, tuple[object, tuple[Copies, Copies]]]] = {}  # peer -> id(local) -> copies
        self._streams = SideStreams()
        self._done: torch.cuda.Event | None = None  # recorded after this rank's copies
        self._done_words: list[int] = []  # ... and its handle as ack words (the same every update)

    def attach(self, peer: int, generation: int, local: Mapping[str, torch.Tensor]) -> None:
        """Map ``peer``'s tensors of ``generation`` and compile the copies read from them."""
        key = self.mapped.wait(peer, generation)
        self._copies.pop(peer, None)
        tensors, written, box = self.mapped.open(peer, key)
        link = self.links[peer]
        if not link.opened:  # the link's first set: choose how it signals
            link.open(box)
        if peer not in self._runs:
            self._runs[peer] = self.share.runs(peer)
        self.mapped.hold(peer, generation, tensors, written, pin=any(t.is_cuda for t in ungated(local).values()))
        self._copies[peer] = {}
        self._compiled(peer, local)

    def _compiled(self, peer: int, local: Mapping[str, torch.Tensor]) -> tuple[Copies, Copies]:
        """The copies from ``peer``'s mapped tensors into ``local``, compiled once per local
        mapping (a staged engine alternates two): (into staging, into served weights).  The
        second is empty unless ``local`` stages a window (``runtime.gated``)."""
        hit = self._copies[peer].get(id(local))
        if hit is None or hit[0] is not local:
            window = window_of(local)
            runs, src = self._runs[peer], self.mapped.sets[peer][1]
            if window is None:
                compiled = (Copies.of(compile_runs(runs, src, local)), Copies.of([]))
            else:
                views = ungated(local)
                into_staging, into_served = (
                    Copies.of(compile_runs([r for r in runs if (r.first.dst_local in window) == staged], src, views))
                    for staged in (True, False))
                compiled = (into_staging, into_served)
            hit = (local, compiled)
            self._copies[peer][id(local)] = hit
        return hit[1]

    def _after_writes(self, peer: int, device: torch.device | None) -> None:
        """This rank's copies from ``peer`` start after the trainer's writes."""
        written = self.mapped.written.get(peer)
        if written is None or written.query():  # nothing recorded, or the writes already ran
            return
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(written)
        else:
            written.synchronize()

    def _complete(self, device: torch.device | None, queued: bool) -> list[int]:
        """After the copies queued so far: the event words of a QUEUED ack, or [] once the
        CPU waited for them (READY)."""
        if device is None or device.type != "cuda":
            return []
        if queued:
            if self._done is None:
                self._done = events.new_event()
            self._done.record(torch.cuda.current_stream(device))  # the first record creates it
            if not self._done_words:
                self._done_words = events.words(self._done, device)
            return self._done_words
        torch.cuda.current_stream(device).synchronize()
        return []

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats:
        """Every trainer gets its ack, even after another one failed: none waits for a timeout.

        Staging copies of every peer go first; copies into served weights (a staging window's
        rest) follow once ``local.open()`` paused the engine."""
        stats = Stats()
        error: Exception | None = None
        gens, waits, queued = {}, {}, {}
        for peer in self.share.peers:
            t0 = time.perf_counter()
            gen, stream = self.links[peer].header(HEADER_WORDS)
            gens[peer] = gen
            queued[peer] = bool(stream)
            waits[peer] = time.perf_counter() - t0
            try:
                if self.mapped.proceed(peer, gen, error, lambda p, g: self.attach(p, g, local)):
                    staged, live = self._compiled(peer, local)
                    queued[peer] &= staged.on_device and live.on_device
                    self._after_writes(peer, staged.device or live.device)
                    staged.run(self._streams.of(staged.device))
            except Exception as e:
                error = error or e
        peers = self.share.peers
        if error is None and any(self._compiled(p, local)[1].device is not None for p in peers):
            try:
                device = next(c.device for p in peers for c in self._compiled(p, local) if c.device is not None)
                if device.type == "cuda":  # the staging copies run while serving, not in the pause
                    torch.cuda.current_stream(device).synchronize()
                assert isinstance(local, Gated), "copies into served weights exist only for a staging window"
                local.open()  # the engine pauses: the rest writes what it serves
            except Exception as e:
                error = e
        for peer in peers:
            t1 = time.perf_counter()
            status, done = FAILED, []
            try:
                if error is None:
                    staged, live = self._compiled(peer, local)
                    live.run(self._streams.of(live.device))
                    done = self._complete(staged.device or live.device, queued[peer])
                    status = QUEUED if done else READY
            except Exception as e:
                error = error or e
            self.links[peer].answer([gens[peer], status, *(done or [0] * events.WORDS)])
            t2 = time.perf_counter()
            stats.transfer_s += waits[peer]
            stats.unpack_s += t2 - t1
            stats.steps.append(StepTiming("map", f"{peer}->{self.share.rank}", self.share.peer_bytes[peer],
                                          transfer_s=waits[peer], unpack_s=t2 - t1))
        if error is not None:
            raise error
        stats.bytes_received = self.share.nbytes
        return stats

    def refuse(self) -> None:
        """Answer an update the engine refused (a pipelined begin: the trainer's signal is on
        its way): take each trainer's header, ack ``REFUSED``, touch nothing."""
        for peer in self.share.peers:
            self.links[peer].refuse(HEADER_WORDS)

    def detach(self) -> None:
        self._copies.clear()
        self.mapped.release()
        for link in self.links.values():
            link.close()
