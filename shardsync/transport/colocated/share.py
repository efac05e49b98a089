"""One sync rank's end of a colocated connection: its sync group and store facts, and its share
of the p2p plan walked link by link (its copies, the peers at their other ends in order, the
bytes of each).  Both ends derive it from the same topology, so a trainer rank and an engine
rank walk the links between them in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardsync.plan.plan import Copy
from shardsync.plan.runs import Run, coalesce
from shardsync.store.keys import Keys
from shardsync.store.sealed import seal, unseal
from shardsync.topology import Topology
from shardsync.transport.group import SyncGroup


@dataclass(frozen=True)
class Share:
    """Sync rank ``group.rank``'s copies of ``topo``'s p2p plan and the store it signs its values in."""

    group: SyncGroup
    keys: Keys  # under the rendezvous name: every store key of the sync
    secret: str  # signs and checks store values (handles, the link's signal choice)
    copies: list[Copy]  # as source (trainer) or as destination (engine)
    peers: list[int]  # sync ranks at the other ends, in the order both sides walk them
    by_peer: dict[int, list[Copy]]  # ``copies`` per peer, in plan order
    shapes: dict[str, tuple[int, ...]]  # trainer: its tensor shapes the plan was built for (checked at export)
    nbytes: int  # on the wire dtype
    peer_bytes: dict[int, int]

    @classmethod
    def sender(cls, group: SyncGroup, topo: Topology, prefix: str, secret: str) -> Share:
        """A trainer rank's share (trainer ranks are the first sync ranks; engine rank ``d`` is ``trainers + d``)."""
        me, trainers = group.rank, topo.trainer.world_size
        plan = topo.p2p_plan
        shapes = {t.name: tuple(t.shape) for t in plan.src.ranks[me].tensors}
        return cls._of(group, prefix, secret, plan.copies_from(me),
                       lambda c: trainers + c.dst, plan.itemsize, shapes)

    @classmethod
    def receiver(cls, group: SyncGroup, topo: Topology, prefix: str, secret: str) -> Share:
        """An engine rank's share: the copies into it, from the trainer ranks."""
        me = group.rank - topo.trainer.world_size
        plan = topo.p2p_plan
        return cls._of(group, prefix, secret, plan.copies_to(me), lambda c: c.src,
                       plan.itemsize, {})

    @classmethod
    def _of(cls, group: SyncGroup, prefix: str, secret: str, copies: list[Copy],
            other: Callable[[Copy], int], itemsize: int, shapes: dict[str, tuple[int, ...]]) -> Share:
        peers = sorted({other(c) for c in copies})
        by_peer: dict[int, list[Copy]] = {p: [] for p in peers}
        for c in copies:
            by_peer[other(c)].append(c)
        return cls(group, Keys(prefix), secret, copies, peers, by_peer, shapes,
                   sum(c.numel for c in copies) * itemsize,
                   {p: sum(c.numel for c in cs) * itemsize for p, cs in by_peer.items()})

    @property
    def rank(self) -> int:
        return self.group.rank

    def runs(self, peer: int) -> list[Run]:
        """The copies of the link to ``peer`` as strided runs (``plan.runs.coalesce``)."""
        return coalesce(self.by_peer[peer])

    # the store, under the group's timeout and the sync's secret
    def wait(self, key: str) -> None:
        self.group.store.wait([key], self.group.rdv.timeout)

    def put(self, key: str, value: str) -> None:
        self.group.store.set(key, seal(key, value, self.secret))

    def get(self, key: str) -> str | bytes:
        """The value at ``key``, its signature checked (the caller waited for it)."""
        return unseal(key, self.group.store.get(key), self.secret)
