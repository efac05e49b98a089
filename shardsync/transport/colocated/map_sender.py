"""The trainer's end of the map path: it exports the tensors its copies read once, and each
update marks the end of its writes, signals every engine rank and returns only after every
ack.  Its tensors are thus never written while an engine reads them, and a tensor that moved
is exported again before any engine reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch

from shardsync.runtime.stats import Stats
from shardsync.transport import events
from shardsync.transport.colocated.exports import Exports
from shardsync.transport.colocated.link import ABORT, QUEUED, TrainerLink, judged, signal
from shardsync.transport.colocated.share import Share


class MapSender:
    """A trainer rank's end of the map path: the engines copy out of its mapped tensors.

    Every update the trainer records its event after its writes (``Exports.mark_written``)
    and signals ``[generation, stream]``; the engine copies after those writes and acks.
    With ``stream`` (``ColocatedConfig(complete="stream")``) between GPUs the engine acks once
    its copies are queued, with its own CUDA IPC event, and this rank's stream waits on it, so
    neither CPU waits for the copy; otherwise the engine synchronizes before it acks.
    Collective contract: ``export`` (at join) before the engines ``attach``; then ``run``
    every update, on both ends, with the same plan.
    """

    def __init__(self, share: Share, *, stream: bool = True, mailbox: bool = True) -> None:
        """``stream``: let engines ack once their copies are queued on the GPU; ``mailbox``:
        offer each engine rank a shared-memory mailbox for the signals."""
        self.share, self.stream = share, stream
        self.links = [TrainerLink(share, p, mailbox) for p in share.peers]
        self.exports = Exports(share, offers=True)
        self.number = 0  # updates signalled
        self._opened = events.Opened()  # the engines' events, from their acks

    def export(self, local: Mapping[str, torch.Tensor]) -> None:
        """Publish handles of the tensors this rank's copies read (the generation bumps)."""
        self.exports.export(local, self.links)

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats:
        stats = Stats()
        t0 = time.perf_counter()
        error = None
        try:
            if self.exports.stale(local):
                self.export(local)
            self.exports.mark_written()  # the engines read only after every write to the weights
        except Exception as e:  # tell the engines now rather than let them wait for a timeout
            error = e
        self.number += 1
        pending = signal(self.links, self.number, [ABORT if error else self.exports.generation, int(self.stream)])
        t1 = time.perf_counter()
        acks = [a() for a in pending]
        for a in acks:  # before any error is raised: the weights stay unwritten until the reads end
            if a[1] == QUEUED:
                self._after_reads(a[2:])
        stats.pack_s = t1 - t0
        stats.transfer_s = time.perf_counter() - t1
        return judged(stats, acks, error, self.share)

    def _after_reads(self, words: list[int]) -> None:
        """Later writes of this rank's stream wait for an engine's queued copies."""
        done = self._opened.of_words(words)
        if self.exports.device is None:
            done.synchronize()
        else:
            torch.cuda.current_stream(self.exports.device).wait_event(done)

    def detach(self) -> None:
        self._opened.clear()
