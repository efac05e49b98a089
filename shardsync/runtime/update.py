"""One update on one sync rank: the steps of the chosen path, run by the one executor.

Collective: every sync rank (trainer ranks of all replicas and every engine rank) calls
``Schedule.run`` for the same mode and version.  Broadcast runs its pipeline stages in
turn; after each stage every rank joins one world barrier, so all ranks make the same
number of barrier calls whatever stage they belong to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from shardsync.runtime.executor import BufferPool, ExecStats, Transport, execute
from shardsync.runtime.schedule import SyncRanks, broadcast_steps, p2p_steps
from shardsync.runtime.steps import Step
from shardsync.topology import Topology

MODES = ("p2p", "broadcast")


@dataclass
class Schedule:
    """Compiled steps of one sync rank, built once at connect and reused every update."""

    topo: Topology
    me: int
    bucket_bytes: int
    credits: int = 2
    device: str | torch.device = "cpu"
    _steps: dict[tuple[str, int], list[Step]] = field(default_factory=dict)
    _pools: dict[str, BufferPool] = field(default_factory=dict)

    def pool(self, mode: str) -> BufferPool:
        """The buffers of one path, reused across its updates (sized by its own peak)."""
        if mode not in self._pools:
            self._pools[mode] = BufferPool(getattr(torch, self.topo.wire_dtype), self.device)
        return self._pools[mode]

    def steps(self, mode: str, stage: int = 0) -> list[Step]:
        key = (mode, stage)
        if key not in self._steps:
            if mode == "p2p":
                self._steps[key] = p2p_steps(self.topo, self.me, self.bucket_bytes)
            elif mode == "broadcast":
                self._steps[key] = broadcast_steps(self.topo, self.me, self.bucket_bytes, stage)
            else:
                raise ValueError(f"mode {mode!r} not one of {MODES}")
        return self._steps[key]

    def subgroups(self) -> dict[str, list[int]]:
        ranks = SyncRanks(self.topo)
        return {f"stage{s}": ranks.stage_group(s) for s in range(self.topo.trainer.pp)}

    def run(self, mode: str, local: Mapping[str, torch.Tensor], transport: Transport, *,
            barrier, detail: bool = False) -> ExecStats:
        if mode == "p2p" and getattr(transport, "one_sided", False):
            return transport.run(local)  # the receiver reads the plan's regions in place
        if mode == "p2p":
            return execute(self.steps("p2p"), local, transport, pool=self.pool("p2p"),
                           credits=self.credits, detail=detail)
        total = ExecStats()
        for stage in range(self.topo.trainer.pp):
            s = execute(self.steps("broadcast", stage), local, transport, pool=self.pool("broadcast"),
                        credits=self.credits, detail=detail)
            barrier()
            total.pack_s += s.pack_s
            total.transfer_s += s.transfer_s
            total.unpack_s += s.unpack_s
            total.bytes_sent += s.bytes_sent
            total.bytes_received += s.bytes_received
            total.steps.extend(s.steps)
        total.peak_buffer_bytes = self.pool("broadcast").allocated_bytes
        return total
