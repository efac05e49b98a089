"""What every path compiles from (``Endpoint``) and what it compiles to (``Program``).

A path turns one sync rank's end of a connection into a program once, at connect; every
update then calls ``Program.run`` on every rank of the sync, trainer and engine alike, so
both sides derive the same compiled steps from the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from shardsync.delta.transfer import Snapshot
from shardsync.dtypes import torch_dtype
from shardsync.piece import RankLayout
from shardsync.runtime.stats import Stats
from shardsync.topology import Topology
from shardsync.transport.colocated.push_receiver import Staging
from shardsync.transport.colocated.push_sender import Producer
from shardsync.transport.group import SyncGroup
from shardsync.vocab import Ipc


@dataclass(frozen=True, kw_only=True)
class Colocated:
    """The p2p path's options for engines on the trainer's machine."""

    ipc: Ipc  # how an engine reads the trainer's memory
    stream: bool = True  # trainer, map: engines ack once their copies are queued (events)
    mailbox: bool = True  # trainer, map: offer engines a shared-memory mailbox for the signals
    staging: Staging | None = None  # engine ranks, push: the staging copies the trainer writes
    producer: Producer | None = None  # trainer, push: writes some of its tensors straight into staging


@dataclass(frozen=True, kw_only=True)
class DeltaSide:
    """The delta paths' options on a trainer rank."""

    snapshot: Snapshot  # the last synced values, diffed against at every delta
    dir: str | None = None  # delta over disk: where versions are published


@dataclass
class Endpoint:
    """One sync rank's end of a connection (trainer ranks first, then engine ranks): what
    every path needs, and the options only some paths read (``colocated``, ``delta``)."""

    topo: Topology
    me: int
    group: SyncGroup | None
    bucket_bytes: int
    credits: int = 2
    device: torch.device | str = "cpu"
    detail: bool = False  # per-bucket timings in the stats
    verify: bool = False  # every message of the sync group checked against its digest
    secret: str = field(repr=False, kw_only=True)  # signs and checks store values (handles)
    tensors: Mapping[str, torch.Tensor] | None = None  # trainer: its weights; engine: what it receives into
    rank_layout: RankLayout | None = None  # engine ranks: the pieces this rank holds
    colocated: Colocated | None = None
    delta: DeltaSide | None = None

    @property
    def is_trainer(self) -> bool:
        return self.me < self.topo.trainer.world_size

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch_dtype(self.topo.wire_dtype)


@dataclass(frozen=True)
class UpdateArgs:
    """Per-update facts a program may need beyond the tensors."""

    version: int = 0
    base_version: int | None = None
    root: str | None = None  # disk deltas: the published directory


class Program:
    """One rank's compiled path; ``run`` is collective over every rank of the sync.

    A path declares what it can do beyond ``run`` here, so callers never ask an object what
    it is: the flags say how the update around it is ordered, the hooks default to nothing.
    """

    buckets: int = 0  # buckets one update moves on this rank (reported per update)
    # the trainer may send before the engines' begin answers arrive: a refusal is answered
    # through the path itself (``refuse``), in place of its bytes
    answers_refusals: ClassVar[bool] = False
    # a receive writes nothing the destination must catch up first (the bytes were written
    # before the receive started: a push), so ``Destination.prepare`` copies nothing
    overwrites: ClassVar[bool] = False

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the program holds (mapped memory, slots); the group is not closed."""
        return None

    def launch(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Trainer, before the engines hear of the update: start what need not wait (a push
        starts its copies).  Nothing by default."""
        return None

    def refuse(self) -> None:
        """Engine: answer an update the host refused whose signal is already on its way
        (``answers_refusals``).  Nothing by default: the trainer waited for the refusal."""
        return None

    def committed(self) -> None:
        """Engine: the receive was committed (a writer in another process learns where the
        next one lands).  Nothing by default."""
        return None

    def publish(self, args: UpdateArgs) -> str:
        """Trainer rank 0, after every rank ran: make the update visible to the engines and
        say where they read it (disk deltas: the version's directory).  Paths that move
        bytes over a group publish nothing."""
        raise NotImplementedError(f"{type(self).__name__} has nothing to publish: engines receive it in run()")
