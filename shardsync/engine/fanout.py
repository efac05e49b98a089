"""Ordered fan-out of one command from worker 0 to every TP worker of the reference engine:
each worker runs it (it is collective over the TP group or the sync group) and answers with
its command number, so a late or lost answer is a ``WorkerError``, never a mix-up.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from shardsync.engine.worker import EngineWorker
from shardsync.vocab import Op

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A TP worker failed or did not answer; the engine cannot serve consistently."""


class FanOut:
    def __init__(self, worker: EngineWorker, peers: list, results) -> None:
        self.worker, self.peers, self.results = worker, peers, results
        self._seq = 0

    def run(self, kind: Op, args: dict[str, Any], timeout_s: float) -> list[Any]:
        """Results of every worker, by TP rank."""
        self._seq += 1
        for q in self.peers:
            q.put((self._seq, kind, args))
        mine: Any = None
        error: BaseException | None = None
        try:
            mine = self.worker.handle(kind, args)
        except BaseException as e:
            error = e
        out: list[Any] = [mine] + [None] * len(self.peers)
        deadline = time.monotonic() + timeout_s
        for _ in self.peers:
            try:
                rank, seq, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerError(f"a TP worker did not finish '{kind}' within {timeout_s}s") from None
            if seq != self._seq:
                raise WorkerError(f"TP worker {rank} answered command {seq}, expected {self._seq}")
            if not ok and error is None:
                error = WorkerError(f"TP worker {rank}: {value}")
            out[rank] = value
        if error is not None:
            raise error
        return out


def peer_loop(worker: EngineWorker, commands, results, events=None) -> None:
    """Main loop of TP workers 1..N-1: run what worker 0 sends until it sends None; a staged
    receive reports to ``events``."""
    if events is not None:
        worker.notify = events.put
    while True:
        msg = commands.get()
        if msg is None:
            return
        seq, kind, args = msg
        try:
            results.put((worker.rank, seq, True, worker.handle(kind, args)))
        except Exception as e:
            log.warning("tp%d: command %s failed: %s", worker.rank, kind, e)
            results.put((worker.rank, seq, False, f"{type(e).__name__}: {e}"))
