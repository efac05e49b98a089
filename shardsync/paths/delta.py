"""Delta over the sync group: only changed elements, diffed on the trainer's shards
(``delta-p2p``: each engine rank gets its parts from their owners; ``delta-broadcast``: a
stage source broadcasts its stage's parts).  Payloads are variable-size byte messages
moved by the one executor (``delta/transfer.py``)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.delta.transfer import DeltaRunner
from shardsync.mode import Mode
from shardsync.paths.base import Endpoint, Program, UpdateArgs
from shardsync.runtime.stats import Stats


class DeltaProgram(Program):
    def __init__(self, ep: Endpoint, mode: Mode) -> None:
        if ep.group is None:
            raise ValueError(f"the {mode} path needs a sync group")
        if ep.is_trainer and ep.delta is None:
            raise ValueError("a trainer rank needs a snapshot of the last synced values for delta (Endpoint.delta)")
        self.mode, self.group = mode, ep.group
        self.runner = DeltaRunner(ep.topo, ep.me, ep.bucket_bytes, credits=ep.credits,
                                  snapshot=ep.delta.snapshot if ep.is_trainer and ep.delta else None,
                                  rank=None if ep.is_trainer else ep.rank_layout, verify=ep.verify)

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        stats = self.runner.run(self.mode.plan.value, tensors, self.group)
        stats.peak_buffer_bytes = self.runner.pool.allocated_bytes
        return stats
