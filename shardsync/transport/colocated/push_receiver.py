"""The engine's end of the push path: it exports its staging sets and commit fence once, and
each update only checks the trainer's header names the set it stages into and acks, since
the trainer already wrote it.  After every commit or refusal it names the set the next update
writes, so a trainer never writes the set being served and a refused or failed update leaves
the served weights untouched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shardsync.runtime.stats import Stats, StepTiming
from shardsync.transport import events
from shardsync.transport.colocated.exports import Mapped
from shardsync.transport.colocated.link import FAILED, READY, EngineLink
from shardsync.transport.colocated.share import Share
from shardsync.transport.handles import export_tensors

HEADER_WORDS = 3  # generation, stream, the staging set written


@dataclass
class Staging:
    """An engine rank's staging copies as a pushing trainer writes them."""

    sets: list[Mapping[str, torch.Tensor]]  # every mapping a receive may write (the layout's views)
    index: Callable[[], int]  # which of ``sets`` the next receive writes
    ready_at: Callable[[torch.cuda.Event], None]  # the commit orders the served stream after it
    fence: Callable[[], torch.cuda.Event | None]  # recorded after every commit (CUDA shards)


class PushReceiver:
    """An engine rank's end of the push path: the trainers write ``staging``; its commit swaps
    the set in, ordering what it serves next after the trainer's event (``Staging.ready_at``)."""

    def __init__(self, share: Share, staging: Staging) -> None:
        self.share, self.staging = share, staging
        self.links = {p: EngineLink(share, p) for p in share.peers}
        self.mapped = Mapped(share)  # each trainer's event (it offers no tensors)

    def attach(self, peer: int, generation: int, local: Mapping[str, torch.Tensor]) -> None:
        """Open ``peer``'s event (and, the first time, its mailbox); offer it the staging sets."""
        key = self.mapped.wait(peer, generation)
        tensors, written, box = self.mapped.open(peer, key)
        if tensors:
            raise ValueError(f"store key {key} offers {len(tensors)} tensor(s); a pushing trainer maps, it offers none")
        link = self.links[peer]
        first = not link.opened
        if first:
            link.open(box)
            if link.box is None:
                raise RuntimeError(f"sync rank {self.share.rank} cannot map trainer sync rank {peer}'s mailbox, "
                                   "which ipc='push' needs (another /dev/shm?): connect with ipc='map'")
        self.mapped.hold(peer, generation, {}, written, pin=False)
        if first:
            self._offer(link)

    def _offer(self, link: EngineLink) -> None:
        """Export every staging set the trainer at ``link`` writes, with the commit fence."""
        names = sorted({c.dst_local for c in self.share.by_peer[link.peer]})
        tensors = {f"{i}/{n}": s[n] for i, s in enumerate(self.staging.sets) for n in names}
        fence = self.staging.fence()
        handle = None if fence is None else events.handle_of(fence, next(t.device for t in tensors.values()))
        key = self.share.keys.staging(self.share.rank, link.peer)
        self.share.put(key, export_tensors(tensors, handle))
        link.post_staged(self.staging.index())

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats:
        """Every trainer gets its ack, even after another one failed: none waits for a timeout."""
        stats = Stats()
        error: Exception | None = None
        staging = self.staging
        for peer in self.share.peers:
            t0 = time.perf_counter()
            link = self.links[peer]
            gen, stream, index = link.header(HEADER_WORDS)
            status = FAILED
            try:
                if self.mapped.proceed(peer, gen, error, lambda p, g: self.attach(p, g, local)):
                    if index != staging.index():
                        raise RuntimeError(f"trainer sync rank {peer} wrote staging set {index}; this rank "
                                           f"stages into set {staging.index()}")
                    written = self.mapped.written.get(peer)
                    if stream and written is not None:
                        staging.ready_at(written)  # the commit waits for the copies on the GPU
                    status = READY
            except Exception as e:
                error = error or e
            link.answer([gen, status] + [0] * events.WORDS)
            wait = time.perf_counter() - t0
            stats.transfer_s += wait
            stats.steps.append(StepTiming("push", f"{peer}->{self.share.rank}", self.share.peer_bytes[peer],
                                          transfer_s=wait))
        if error is not None:
            raise error
        stats.bytes_received = self.share.nbytes
        return stats

    def committed(self) -> None:
        """The engine committed: each trainer may write the set staged next."""
        for link in self.links.values():
            if link.box is not None and link.opened:  # attached (not left)
                link.post_staged(self.staging.index())

    def refuse(self) -> None:
        for peer in self.share.peers:
            link = self.links[peer]
            link.refuse(HEADER_WORDS)
            link.post_staged(self.staging.index())  # nothing was committed: the same set again

    def detach(self) -> None:
        self.mapped.release()
        for link in self.links.values():
            link.close()
