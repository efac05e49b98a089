"""A transport wrapper that timestamps every transfer, buffer pools, control barriers.

The runtime executor needs no hook: it calls ``send/recv/broadcast`` when a buffer is
posted and ``wait`` when it retires the buffer, so the wrapper sees exactly how long
each buffer is held in flight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from shardsync.bench.topology import BenchLayout
from shardsync.runtime.executor import BufferPool, Pooled, Transport

CLOCK = "time.perf_counter"
_clock = time.perf_counter


@dataclass
class Transfer:
    """One buffer's time in flight on one rank: posted at ``t_post``, retired at ``t_end``."""

    group: int
    kind: str
    nbytes: int
    t_post: float
    t_end: float | None = None
    synced: bool = False

    def row(self) -> list:
        return [self.group, self.kind, self.nbytes, self.t_post, self.t_end, self.synced]


class _TimedWork:
    def __init__(self, work, rec: Transfer, owner: TracingTransport) -> None:
        self._work, self._rec, self._owner = work, rec, owner

    def wait(self) -> None:
        self._work.wait()
        self._rec.synced = self._owner.device_sync()
        self._rec.t_end = _clock()


class TracingTransport(Pooled):
    """Records a ``Transfer`` per call; on CUDA every completion time follows a device sync.

    Without the sync a completion time on CUDA would only mean "enqueued", so the
    provenance check refuses records whose ``synced`` is False there.
    """

    def __init__(self, inner: Transport, layout: BenchLayout, rank: int,
                 device: torch.device | None = None) -> None:
        self.inner, self.layout, self.rank = inner, layout, rank
        self.device = device if device is not None else torch.device("cpu")
        self.records: list[Transfer] = []
        self.device_syncs = 0

    def device_sync(self) -> bool:
        if self.device.type != "cuda":
            return False
        torch.cuda.synchronize(self.device)
        self.device_syncs += 1
        return True

    def _group(self, peer: int) -> int:
        g = self.layout.group_of(peer)
        if g is None:
            g = self.layout.group_of(self.rank)
        assert g is not None, f"transfer between trainer ranks {self.rank} and {peer}"
        return g

    def _post(self, group: int, kind: str, buf: torch.Tensor, call) -> _TimedWork:
        rec = Transfer(group, kind, buf.numel() * buf.element_size(), _clock())
        self.records.append(rec)
        return _TimedWork(call(), rec, self)

    def send(self, buf: torch.Tensor, peer: int) -> _TimedWork:
        return self._post(self._group(peer), "send", buf, lambda: self.inner.send(buf, peer))

    def recv(self, buf: torch.Tensor, peer: int) -> _TimedWork:
        return self._post(self._group(peer), "recv", buf, lambda: self.inner.recv(buf, peer))

    def broadcast(self, buf: torch.Tensor, group: str, root: int) -> _TimedWork:
        g = int(group.removeprefix("data"))
        kind = "bcast_root" if self.rank == self.layout.data_members(g)[root] else "bcast"
        return self._post(g, kind, buf, lambda: self.inner.broadcast(buf, group, root))

    def synchronize(self) -> None:
        self.inner.synchronize()

    def take(self) -> list[Transfer]:
        out, self.records = self.records, []
        return out


class FreshPool(BufferPool):
    """Buffer reuse off: every transfer allocates its own buffer, dropped after use."""

    def get(self, numel: int, size: int = 0) -> torch.Tensor:
        del size  # no reuse: every transfer gets a buffer of exactly its size
        buf = torch.empty(numel, dtype=self.dtype, device=self.device)
        self.allocated_bytes += buf.numel() * buf.element_size()
        return buf

    def put(self, buf: torch.Tensor) -> None:
        pass


def make_pool(reuse: bool, device: torch.device) -> BufferPool:
    """Bytes travel as ``uint8`` so a message of ``n`` bytes is ``n`` elements."""
    return (BufferPool if reuse else FreshPool)(torch.uint8, device)


def group_barrier(group, name: str) -> None:
    """Barrier on the named subgroup of a ``SyncGroup`` (every member calls it, in order)."""
    pg, _ = group.groups[name]
    t = torch.zeros(1, device=group.device) if group.device is not None else torch.zeros(1)
    pg.allreduce([t]).wait(group.rdv.timeout)
    group.synchronize()
