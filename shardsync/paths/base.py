"""What every path compiles from (``Endpoint``) and what it compiles to (``Program``).

A path turns one sync rank's end of a connection into a program once, at connect; every
update then calls ``Program.run`` on every rank of the sync, trainer and engine alike, so
both sides derive the same compiled steps from the same code.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from shardsync.delta.transfer import Snapshot
from shardsync.layout.piece import RankLayout
from shardsync.runtime.stats import Stats
from shardsync.topology import Topology
from shardsync.transport.group import SyncGroup
from shardsync.transport.pushed import Staging


@dataclass
class Endpoint:
    """One sync rank's end of a connection (trainer ranks first, then engine ranks)."""

    topo: Topology
    me: int
    group: SyncGroup | None
    bucket_bytes: int
    credits: int = 2
    device: torch.device | str = "cpu"
    ipc: str | None = None  # colocated engines: "map", "slots" or "push"
    ipc_stream: bool = True  # trainer, map: engines ack once their copies are queued (events)
    ipc_mailbox: bool = True  # trainer, map: offer engines a shared-memory mailbox for the signals
    detail: bool = False
    tensors: Mapping[str, torch.Tensor] | None = None  # what IPC exports or maps into at compile
    rank_layout: RankLayout | None = None  # engine ranks: the pieces this rank holds
    snapshot: Snapshot | None = None  # trainer ranks with delta: the last synced values
    delta_dir: str | None = None  # trainer ranks with delta over disk
    verify: bool = False  # every message of the sync group checked against its digest
    secret: str | None = field(default=None, repr=False)  # signs and checks store values (handles)
    staging: Staging | None = None  # engine ranks, push: the staging copies the trainer writes

    @property
    def is_trainer(self) -> bool:
        return self.me < self.topo.trainer.world_size

    @property
    def wire_dtype(self) -> torch.dtype:
        return getattr(torch, self.topo.wire_dtype)


@dataclass(frozen=True)
class UpdateArgs:
    """Per-update facts a program may need beyond the tensors."""

    version: int = 0
    base_version: int | None = None
    root: str | None = None  # disk deltas: the published directory


class Program(Protocol):
    """One rank's compiled path; ``run`` is collective over every rank of the sync."""

    buckets: int

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats: ...

    def close(self) -> None: ...
