"""broadcast: per pipeline stage, gather TP shards at one source, broadcast whole tensors to
every engine rank, each keeps its slice.  The always-working path and the fallback.

After each stage every rank joins one world barrier, so all ranks make the same number of
barrier calls whatever stage they belong to.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.paths.base import Endpoint, Program, UpdateArgs
from shardsync.runtime.executor import BufferPool, execute
from shardsync.runtime.schedule import broadcast_steps
from shardsync.runtime.stats import Stats


class BroadcastProgram(Program):
    def __init__(self, ep: Endpoint) -> None:
        if ep.group is None:
            raise ValueError("the broadcast path needs a sync group")
        self.ep, self.group = ep, ep.group
        self.stages = [broadcast_steps(ep.topo, ep.me, ep.bucket_bytes, s) for s in range(ep.topo.trainer.pp)]
        self.pool = BufferPool(ep.wire_dtype, ep.device)
        self.buckets = sum(len(s) for s in self.stages)

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        total = Stats()
        for steps in self.stages:
            total.merge(execute(steps, tensors, self.group, pool=self.pool, credits=self.ep.credits,
                                detail=self.ep.detail, verify=self.ep.verify))
            self.group.barrier()
        total.peak_buffer_bytes = self.pool.allocated_bytes
        total.buckets = self.buckets
        return total
