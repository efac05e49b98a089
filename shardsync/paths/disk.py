"""Delta over a directory: trainer ranks write their stage's parts, rank 0 publishes the
version atomically; each engine rank applies what falls in its pieces (``delta/disk.py``).
No sync group on the engine side: a pull needs only the directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from shardsync.delta.disk import DiskPublisher, apply_version
from shardsync.paths.base import Endpoint, Program, UpdateArgs
from shardsync.piece import RankLayout
from shardsync.runtime.stats import Stats


class DiskWrite(Program):
    """Trainer side; collective over the trainer ranks of the sync group."""

    def __init__(self, ep: Endpoint) -> None:
        if ep.delta is None or not ep.delta.dir:
            raise ValueError("delta over disk needs a directory and a snapshot on every trainer rank (Endpoint.delta)")
        Path(ep.delta.dir).mkdir(parents=True, exist_ok=True)
        self.root = ep.delta.dir
        self.publisher = DiskPublisher(ep.topo, ep.me, ep.delta.dir, ep.delta.snapshot, budget=ep.bucket_bytes,
                                       credits=ep.credits, verify=ep.verify)
        self.group = ep.group

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        assert args.base_version is not None, "a disk delta is against a base version"
        return self.publisher.write(args.version, args.base_version, self.group)

    def publish(self, args: UpdateArgs) -> str:
        """Trainer rank 0, after every rank wrote: the version appears atomically under the root."""
        assert args.base_version is not None, "a disk delta is against a base version"
        self.publisher.publish(args.version, args.base_version)
        return self.root


class DiskApply(Program):
    """Engine side: one rank applies a published version (part targets cached across pulls)."""

    def __init__(self, rank: RankLayout) -> None:
        self.rank = rank
        self._targets: dict = {}

    def run(self, tensors: Mapping[str, torch.Tensor], args: UpdateArgs) -> Stats:
        assert args.root is not None and args.base_version is not None
        return apply_version(args.root, args.version, args.base_version, tensors, self.rank, self._targets)
