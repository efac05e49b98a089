"""Standalone process groups spanning trainer and engine processes (never a default group).

Every member connects to one TCPStore (hosted by trainer rank 0) and builds its groups
under a name prefix, so several syncs (and the trainer's own world) coexist; the groups'
rendezvous values are signed and every member proves it holds the sync's secret before the
group is used (``transport/proof.py``).  Every operation carries the group timeout; a
timed-out gloo group is broken for good, so the owner must ``close`` it and connect again.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardsync.runtime.executor import Pooled
from shardsync.store.liveness import Heartbeat
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.store.signed import SignedStore
from shardsync.transport.proof import prove

log = logging.getLogger(__name__)


def _make_pg(store: dist.Store, rank: int, size: int, backend: str, timeout: datetime.timedelta,
             device: torch.device | None) -> Any:  # torch's stubs declare no collectives on Backend: Any
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        return pg
    raise ValueError(f"backend {backend!r} not supported; use gloo or nccl")


class _Work:
    """A handle whose ``wait`` always applies the group's timeout (then runs ``then``)."""

    def __init__(self, work, timeout: datetime.timedelta, then=None) -> None:
        self._work, self._timeout, self._then = work, timeout, then

    def wait(self) -> None:
        self._work.wait(self._timeout)
        if self._then is not None:
            self._then()
            self._then = None


class _PinnedPool:
    """Pinned host buffers for device tensors gloo cannot read in place, reused across
    messages (a bucket schedule sends the same sizes every update)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((like.numel(), like.dtype))
        host = free.pop() if free else torch.empty(like.numel(), dtype=like.dtype, pin_memory=True)
        return host.view(like.shape)

    def give(self, host: torch.Tensor) -> None:
        self._free.setdefault((host.numel(), host.dtype), []).append(host.view(-1))


class SyncGroup(Pooled):
    """The ranks of one sync and their groups: the whole world and named subgroups.

    Collective contract: every member constructs it with the same ``rdv``, ``secret`` and
    ``subgroups`` (name -> member sync ranks, first member is the root), in the same order.
    ``who`` names a sync rank in errors (a member that fails its proof).  ``heartbeat``: the
    store counter this member beats while it is in the group (engine ranks: ``store/liveness``).
    """

    def __init__(self, rdv: Rendezvous, rank: int, subgroups: Mapping[str, Sequence[int]] | None = None,
                 *, secret: str, store: dist.Store | None = None, device: torch.device | None = None,
                 who: Callable[[int], str] = lambda r: f"sync rank {r}", heartbeat: str | None = None) -> None:
        self.rdv, self.rank = rdv, rank
        self._heartbeat: Heartbeat | None = None
        self.device = device
        self.store = store if store is not None else open_store(rdv, is_master=False)
        self._signed = SignedStore(self.store, secret)  # alive as long as the groups built on it
        base = dist.PrefixStore(rdv.name, self._signed)
        self.groups: dict[str, tuple[Any, list[int]]] = {}  # name -> (process group, members) as _make_pg
        self.world = _make_pg(dist.PrefixStore("world", base), rank, rdv.world_size, rdv.backend,
                              rdv.timeout, device)
        try:
            self._prove(self.world, "world", list(range(rdv.world_size)), secret, who)
            for name, members in (subgroups or {}).items():
                members = list(members)
                if rank in members:
                    pg = _make_pg(dist.PrefixStore(name, base), members.index(rank), len(members),
                                  rdv.backend, rdv.timeout, device)
                    self.groups[name] = (pg, members)
                    self._prove(pg, name, members, secret, who)
            if heartbeat is not None:
                self._heartbeat = Heartbeat(rdv, heartbeat)
        except BaseException:
            self.close()
            raise
        self._tag = 0
        self._pinned = _PinnedPool()
        self.barrier_calls = 0

    def _prove(self, pg: Any, name: str, members: list[int], secret: str, who: Callable[[int], str]) -> None:
        prove(pg, len(members), members.index(self.rank), context=f"{self.rdv.name}/{name}", secret=secret,
              timeout=self.rdv.timeout, device=self.device if self.rdv.backend == "nccl" else None,
              who=lambda i: who(members[i]))

    def send(self, buf: torch.Tensor, peer: int) -> _Work:
        if buf.is_cuda and self.rdv.backend == "gloo":  # gloo moves host memory: stage
            host = self._pinned.take(buf)
            host.copy_(buf)
            work = self.world.send([host], peer, 0)
            return _Work(work, self.rdv.timeout, then=lambda: self._pinned.give(host))
        return _Work(self.world.send([buf], peer, 0), self.rdv.timeout)

    def recv(self, buf: torch.Tensor, peer: int) -> _Work:
        if buf.is_cuda and self.rdv.backend == "gloo":
            host = self._pinned.take(buf)

            def land() -> None:
                buf.copy_(host)
                self._pinned.give(host)

            return _Work(self.world.recv([host], peer, 0), self.rdv.timeout, then=land)
        return _Work(self.world.recv([buf], peer, 0), self.rdv.timeout)

    def broadcast(self, buf: torch.Tensor, group: str, root: int) -> _Work:
        pg, _ = self.groups[group]
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        return _Work(pg.broadcast([buf], opts), self.rdv.timeout)

    def barrier(self) -> None:
        """Whole-world barrier (every member calls it the same number of times)."""
        self.barrier_calls += 1
        t = torch.zeros(1, device=self.device) if self.device is not None else torch.zeros(1)
        self.world.allreduce([t]).wait(self.rdv.timeout)

    def allreduce_max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MAX)  # the conversion pybind makes implicitly
        self.world.allreduce([t], opts).wait(self.rdv.timeout)
        return float(t.item())

    def synchronize(self) -> None:
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        for pg, _ in self.groups.values():
            _shutdown(pg)
        _shutdown(self.world)
        self.groups.clear()


def _shutdown(pg: Any) -> None:  # a gloo or NCCL backend: shutdown is declared on their base
    try:
        pg.shutdown()
    except Exception:  # a broken group may refuse; it is dropped either way
        log.debug("process group shutdown failed", exc_info=True)
