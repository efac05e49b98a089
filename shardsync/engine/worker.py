"""One reference-engine TP worker: the model shard, serving it, and hosting a ``Receiver``.

Workers are driven by commands (plain dicts over in-host queues, never the network) that
worker 0 fans out in one order to every worker; each command is collective over the
engine's TP group or the sync group.  The update session lives on worker 0.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from shardsync.control.report import rank_report
from shardsync.control.wire import ConnectRequest
from shardsync.mode import Mode
from shardsync.models.engine import EngineModel
from shardsync.paths import UpdateArgs
from shardsync.receiver import Params, Receiver
from shardsync.spec import ModelSpec


class EngineWorker:
    def __init__(self, model: EngineModel, rank: int, tp: int, *, secret: str | None = None) -> None:
        self.model, self.rank, self.tp = model, rank, tp
        for p in model.parameters():
            p.requires_grad_(False)
        self.ep = model.ep
        self.receiver = Receiver(model.spec, rank, tp, Params(dict(model.named_parameters())),
                                 dtype=model.dtype, device=model.device, secret=secret, ep=model.ep)

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    # -- commands (each one is called on every worker, in the same order) --

    def generate(self, **kw: Any) -> list:
        return self.model.generate(**kw)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.model.score(sequences)

    def join(self, req: dict[str, Any]) -> dict[str, Any]:
        """Join the sync group a trainer opened (blocks, bounded, until every member arrives)."""
        return {"rank": self.rank, "sync_rank": self.receiver.join(ConnectRequest.model_validate(req))}

    def update(self, version: int, mode: str) -> dict[str, Any]:
        """Receive one update into the parameters, in place."""
        t0 = time.perf_counter()
        try:
            stats = self.receiver.receive(Mode(mode), UpdateArgs(version=version))
        except Exception as e:  # the receiver left the broken group; the dispatcher marks stale
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return rank_report(stats, t0, self.receiver.destination.name).model_dump()

    def pull(self, root: str, version: int, current: int) -> dict[str, Any]:
        """Apply delta ``version`` from ``root`` (a shared directory) to this rank's weights."""
        t0 = time.perf_counter()
        try:
            stats = self.receiver.pull(root, version, current)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return rank_report(stats, t0, self.receiver.destination.name).model_dump()

    def checksum(self) -> dict:
        return self.receiver.checksums()

    def disconnect(self) -> None:
        self.receiver.leave()

    def handle(self, kind: str, args: dict[str, Any]) -> Any:
        fn = COMMANDS.get(kind)
        if fn is None:
            raise ValueError(f"unknown engine command {kind!r}")
        with torch.no_grad():
            return fn(self, **args)


COMMANDS = {f.__name__: f for f in (EngineWorker.generate, EngineWorker.score, EngineWorker.join,
                                     EngineWorker.update, EngineWorker.pull, EngineWorker.checksum,
                                     EngineWorker.disconnect)}

