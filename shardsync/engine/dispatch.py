"""Fan-out of commands from worker 0 to every TP worker, one command at a time.

Commands run strictly in submission order, so a weight update and a generation never
interleave: requests that arrive during an update wait (bounded by their deadline) and
run on the new weights.  An update's outcome is settled in the session here, in the
dispatch thread, before the next command runs: every result carries the version it ran on.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shardsync.control.report import reduce_reports
from shardsync.control.session import Stale, UpdateSession
from shardsync.control.wire import UpdateResult
from shardsync.engine.worker import EngineWorker

log = logging.getLogger(__name__)


class BusyError(RuntimeError):
    """The request waited longer than its deadline (an update was in progress)."""


class WorkerError(RuntimeError):
    """A TP worker failed or did not answer; the engine cannot serve consistently."""


SERVING = ("generate", "score")
UPDATES = {"update": None, "pull": "delta-disk"}  # commands that write weights -> mode (None: in args)
# Weight commands go ahead of queued serving (an update is never starved by generation); a
# request overtaken by an update runs on the new weights and says so (its version).
PRIORITY = {"generate": 1, "score": 1, "checksum": 1}
STOP = 9


@dataclass
class Command:
    kind: str
    args: dict[str, Any]
    future: Future = field(default_factory=Future)
    started: Future = field(default_factory=Future)  # set when the workers begin running it
    deadline: float | None = None
    timeout_s: float = 300.0


class Dispatcher:
    def __init__(self, worker: EngineWorker, peers: list, results, session: UpdateSession, *,
                 max_queue: int = 256) -> None:
        self.worker, self.peers, self.results, self.session = worker, peers, results, session
        self._q: queue.PriorityQueue[tuple[int, int, Command | None]] = queue.PriorityQueue(maxsize=max_queue)
        self._order = itertools.count()
        self._seq = 0
        self.current: str | None = None

    def submit(self, kind: str, args: dict[str, Any], *, wait_s: float | None = None,
               timeout_s: float = 300.0) -> Future:
        return self.command(kind, args, wait_s=wait_s, timeout_s=timeout_s).future

    def command(self, kind: str, args: dict[str, Any], *, wait_s: float | None = None,
                timeout_s: float = 300.0) -> Command:
        """Queue a command; its ``started`` and ``future`` report progress."""
        cmd = Command(kind, args, deadline=None if wait_s is None else time.monotonic() + wait_s,
                      timeout_s=timeout_s)
        try:
            self._q.put_nowait((PRIORITY.get(kind, 0), next(self._order), cmd))
        except queue.Full:
            raise BusyError(f"engine queue full ({self._q.maxsize} commands waiting)") from None
        return cmd

    def stop(self) -> None:
        self._q.put((STOP, next(self._order), None))

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._loop, name="engine-dispatch", daemon=True)
        t.start()
        return t

    def _loop(self) -> None:
        while True:
            _, _, cmd = self._q.get()
            if cmd is None:
                for q in self.peers:
                    q.put(None)
                return
            if cmd.deadline is not None and time.monotonic() > cmd.deadline:
                self._skip(cmd, BusyError("request waited too long: a weight update was in progress; retry"))
                continue
            if cmd.kind in SERVING and self.session.stale:
                self._skip(cmd, Stale(self.session.stale_message()))
                continue
            self._seq += 1
            self.current = cmd.kind
            version = self.session.version
            cmd.started.set_result(None)
            try:
                results = self._run(cmd)
            except BaseException as e:  # delivered to the waiting caller
                if cmd.kind in UPDATES:
                    self._settle(cmd, [], f"{type(e).__name__}: {e}")
                if isinstance(e, WorkerError):
                    self.session.fail(f"worker failure: {e}")
                cmd.future.set_exception(e)
                continue
            finally:
                self.current = None
            if cmd.kind in UPDATES:
                cmd.future.set_result((self._settle(cmd, results), self.session.version))
            else:
                cmd.future.set_result((results, version))

    @staticmethod
    def _skip(cmd: Command, error: Exception) -> None:
        cmd.started.set_exception(error)
        cmd.future.set_exception(error)

    def _settle(self, cmd: Command, results: list[dict], error: str | None = None) -> UpdateResult:
        mode = UPDATES[cmd.kind] or cmd.args["mode"]
        res = self.session.settle(reduce_reports(cmd.args["version"], mode, results, error))
        if not res.ok:
            log.warning("engine stale: %s", self.session.stale_reason)
        return res

    def _run(self, cmd: Command) -> list[Any]:
        """Results of every worker, by TP rank."""
        for q in self.peers:
            q.put((self._seq, cmd.kind, cmd.args))
        mine: Any = None
        error: BaseException | None = None
        try:
            mine = self.worker.handle(cmd.kind, cmd.args)
        except BaseException as e:
            error = e
        out: list[Any] = [mine] + [None] * len(self.peers)
        deadline = time.monotonic() + cmd.timeout_s
        for _ in self.peers:
            try:
                rank, seq, ok, value = self.results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise WorkerError(f"a TP worker did not finish {cmd.kind!r} within {cmd.timeout_s}s") from None
            if seq != self._seq:
                raise WorkerError(f"TP worker {rank} answered command {seq}, expected {self._seq}")
            if not ok and error is None:
                error = WorkerError(f"TP worker {rank}: {value}")
            out[rank] = value
        if error is not None:
            raise error
        return out


def peer_loop(worker: EngineWorker, commands, results) -> None:
    """Main loop of TP workers 1..N-1: run what worker 0 sends until it sends None."""
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
