"""The reference engine's scheduler: worker 0 fans commands out to every TP worker, one at a
time, and between commands decodes every running sequence by ``Serving.tokens_per_step``
tokens (a step; default one).

Weights change only between two steps.  In place (``staging_bytes=0``) an update's receive
is one command, so generation stops for all of it; staged, the workers receive into staging
on threads of their own while steps go on, and only the commit is a command.  When the
weights change under running sequences, ``Serving.crossing`` decides: ``finish`` (the change
waits, bounded, for them to end on the old version; new requests wait with it), ``span``
(they go on, re-prefilled on the new weights, and their version spans say so) or ``abort``
(they end with a retryable error).  Every token carries the version that produced it.

Over 400 lines on purpose: the scheduler's state (pending update, running sequences, the
crossing policy) is one state machine under one lock, kept in this module; the records it
holds are ``engine.requests``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Literal

from shardsync.control.session import Stale, UpdateSession
from shardsync.engine.fanout import FanOut, WorkerError, peer_loop
from shardsync.engine.requests import (
    PRIORITY,
    SERVING,
    UPDATES,
    Aborted,
    BusyError,
    Command,
    Pending,
    Request,
    Seq,
    Serving,
)
from shardsync.engine.worker import EngineWorker
from shardsync.runtime.ledger import Served, UpdateResult
from shardsync.vocab import Crossing, Op, Phase, Staging

__all__ = ["Aborted", "BusyError", "Dispatcher", "Serving", "WorkerError", "peer_loop"]

log = logging.getLogger(__name__)


DEFAULT_SERVING = Serving()
EVENT, STOP = -1, 9  # a staged receive's report goes ahead of everything


class Dispatcher:
    def __init__(self, worker: EngineWorker, peers: list, results, session: UpdateSession, *,
                 max_queue: int = 256, serving: Serving = DEFAULT_SERVING, events=None) -> None:
        self.worker, self.peers, self.session = worker, peers, session
        self.serving = serving
        self.fanout = FanOut(worker, peers, results)
        self._q: queue.PriorityQueue[tuple[int, int, Command | None]] = queue.PriorityQueue(maxsize=max_queue)
        self._order = itertools.count()
        self._sids = itertools.count()
        self._events = events  # staged reports of TP workers 1..N-1 (a process queue)
        self.requests: list[Request] = []
        self.waiting: deque[Command] = deque()
        self.deferred: list[Command] = []  # join/disconnect while an update is pending
        self.pending: Pending | None = None
        self._refill: set[int] = set()
        self._drop: list[int] = []
        if worker.staged:
            worker.notify = self._staged

    @property
    def staged(self) -> bool:
        return self.worker.staged

    def submit(self, kind: Op, args: dict[str, Any], *, wait_s: float | None = None,
               timeout_s: float = 300.0) -> Future:
        return self.command(kind, args, wait_s=wait_s, timeout_s=timeout_s).future

    def command(self, kind: Op, args: dict[str, Any], *, wait_s: float | None = None,
                timeout_s: float = 300.0) -> Command:
        """Queue a command; its ``started`` and ``future`` report progress.  ``kind`` is
        checked here, where commands enter (the loop compares words by identity)."""
        deadline = None if wait_s is None else time.monotonic() + wait_s
        cmd = Command(Op.parse(kind, "engine command"), args, deadline=deadline, timeout_s=timeout_s)
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
        if self._events is not None:
            threading.Thread(target=self._forward, name="engine-staged", daemon=True).start()
        return t

    # -- the loop --

    def _staged(self, msg: tuple[int, int, dict]) -> None:
        self._q.put((EVENT, next(self._order), Command(Op.STAGED, {"msg": msg})))

    def _forward(self) -> None:
        while True:
            msg = self._events.get()
            if msg is None:
                return
            self._staged(msg)

    def _paused(self) -> bool:
        """A window's rest is being written in place: no forward may run."""
        return self.pending is not None and self.pending.phase is Phase.OPEN

    def _busy(self) -> bool:
        if self._paused():
            return False  # wait for the receive's reports, do not spin
        return bool(self.requests) or (self.pending is not None and self.pending.phase is Phase.GATE) or (
            bool(self.waiting) and not self._holding())

    def _loop(self) -> None:
        while True:
            if self._busy():
                got = [self._next(0)]
            else:  # idle: sleep until a command comes (or a staged receive's deadline check)
                got = [self._next(None if self.pending is None else 1.0)]
            while got[-1] is not False and len(got) < 64 and not self._q.empty():
                got.append(self._next(0))
            for item in got:
                if item is None:
                    self._shutdown()
                    return
                if item is not False:
                    self._accept(item)
            self._progress()
            self._admit()
            if (self.requests or self._drop) and not self._paused():
                self._step()

    def _next(self, timeout: float | None) -> Command | None | Literal[False]:
        """The next command, None to stop, False when none came within ``timeout``."""
        try:
            return self._q.get_nowait()[2] if timeout == 0 else self._q.get(timeout=timeout)[2]
        except queue.Empty:
            return False

    def _shutdown(self) -> None:
        for q in self.peers:
            q.put(None)
        stopping = BusyError("engine stopping")
        for r in self.requests:
            r.cmd.future.set_exception(stopping)
        for c in [*self.waiting, *self.deferred] + ([self.pending.cmd] if self.pending else []):
            if not c.future.done():
                self._skip(c, stopping)

    def _accept(self, cmd: Command) -> None:
        if cmd.kind is Op.STAGED:
            self._on_staged(*cmd.args["msg"])
            return
        if cmd.deadline is not None and time.monotonic() > cmd.deadline:
            self._skip(cmd, BusyError("request waited too long: a weight update was in progress; retry"))
        elif cmd.kind in SERVING and self.session.stale:
            self._skip(cmd, Stale(self.session.stale_message()))
        elif cmd.kind is Op.GENERATE:
            self.waiting.append(cmd)
        elif cmd.kind in UPDATES:
            self._begin_update(cmd)
        elif cmd.kind in (Op.JOIN, Op.DISCONNECT) and self.pending is not None:
            self.deferred.append(cmd)
        elif self._paused():  # score, checksum, ... would read weights being written
            self.deferred.append(cmd)
        else:
            self._now(cmd)

    @staticmethod
    def _skip(cmd: Command, error: Exception) -> None:
        if not cmd.started.done():
            cmd.started.set_exception(error)
        cmd.future.set_exception(error)

    def _now(self, cmd: Command) -> None:
        """A command that runs between two steps (score, checksum, join, ...)."""
        version = self.session.version
        cmd.started.set_result(None)
        try:
            results = self.fanout.run(cmd.kind, cmd.args, cmd.timeout_s)
        except BaseException as e:  # delivered to the waiting caller
            self._failed(e)
            cmd.future.set_exception(e)
            return
        cmd.future.set_result((results, version))

    def _failed(self, e: BaseException) -> None:
        if isinstance(e, WorkerError):
            self.session.fail(f"worker failure: {e}")
            self._end_running(Stale(self.session.stale_message()))

    # -- generation --

    def _holding(self) -> bool:
        """New requests wait while a change waits for running ones to finish on the old version."""
        p = self.pending
        return p is not None and (p.phase is Phase.OPEN or (p.phase is Phase.GATE and p.crossing is Crossing.FINISH))

    def _running(self) -> list[Seq]:
        return [s for r in self.requests for s in r.seqs if not s.done]

    def _admit(self) -> None:
        if self._holding():
            return
        running = len(self._running())
        while self.waiting and running < self.serving.max_running:
            cmd = self.waiting.popleft()
            if cmd.deadline is not None and time.monotonic() > cmd.deadline:
                self._skip(cmd, BusyError("request waited too long: a weight update was in progress; retry"))
                continue
            if self.session.stale:
                self._skip(cmd, Stale(self.session.stale_message()))
                continue
            sids = [next(self._sids) for _ in cmd.args["prompts"]]
            cmd.started.set_result(None)
            try:
                self.fanout.run(Op.ADMIT, dict(cmd.args, sids=sids), cmd.timeout_s)
            except BaseException as e:  # a prompt the model refuses fails its request alone
                self._failed(e)
                cmd.future.set_exception(e)
                continue
            done = cmd.args["max_new_tokens"] == 0
            self.requests.append(Request(cmd, [Seq(sid, done=done) for sid in sids]))
            running += 0 if done else len(sids)
        self._complete()

    def _step(self) -> None:
        running = self._running()
        if not running and not self._drop:
            self._complete()
            return
        ids = {s.sid for s in running}
        args = {"advance": [s.sid for s in running], "refill": sorted(self._refill & ids), "drop": self._drop,
                "tokens": self.serving.tokens_per_step}
        self._refill, self._drop = set(), []
        version = self.session.version
        try:
            out = self.fanout.run(Op.STEP, args, 300.0)[0]
        except BaseException as e:
            self._failed(e)
            self._end_running(e)
            return
        for s in running:
            tokens, logprobs, done = out[s.sid]
            for token, logprob in zip(tokens, logprobs, strict=True):
                s.add(token, logprob, version)
            s.done = done
        self._complete()

    def _complete(self) -> None:
        for r in [r for r in self.requests if all(s.done for s in r.seqs)]:
            self.requests.remove(r)
            versions = [span[0] for s in r.seqs for span in s.spans]
            r.cmd.future.set_result(([(s.tokens, s.logprobs, s.spans) for s in r.seqs],
                                     max(versions, default=self.session.version)))

    def _end_running(self, error: BaseException) -> int:
        """End every request with a running sequence; returns how many sequences it cut."""
        cut = 0
        for r in [r for r in self.requests if any(not s.done for s in r.seqs)]:
            self.requests.remove(r)
            live = [s.sid for s in r.seqs if not s.done]
            cut += len(live)
            self._drop += live
            r.cmd.future.set_exception(error)
        return cut

    # -- weight updates --

    def _begin_update(self, cmd: Command) -> None:
        asked = cmd.args.pop("crossing", None)  # the trainer's, else the engine's
        crossing = self.serving.crossing if asked is None else Crossing.parse(asked, "crossing")
        self.pending = p = Pending(cmd, self.staged, time.monotonic(), crossing)
        if not p.staged:
            return  # in place: the receive waits for the gate
        p.phase = Phase.STAGING
        cmd.started.set_result(None)
        try:
            self.fanout.run(Op.STAGE, {"kind": cmd.kind, "version": cmd.args["version"], "args": cmd.args,
                                       "wait_s": cmd.timeout_s}, cmd.timeout_s)
        except BaseException as e:
            self._failed(e)
            self._finish(p, [], error=f"{type(e).__name__}: {e}", kept=True, exc=e)

    def _on_staged(self, rank: int, version: int, report: dict) -> None:
        p = self.pending
        if p is None or not p.staged or p.cmd.args["version"] != version or (
                p.phase not in (Phase.STAGING, Phase.OPEN) and not p.window):
            log.debug("staged report of tp%d for v%d arrived after its update ended", rank, version)
            return
        if report.get("gate"):  # a window's receive reached the served weights: pause the engine
            if p.phase is Phase.STAGING:
                p.phase, p.window, p.stage_s = Phase.GATE, True, time.monotonic() - p.t0
            return
        p.touched |= bool(report.pop("touched", False))
        p.reports[rank] = report
        if len(p.reports) < 1 + len(self.peers):
            return
        if p.phase is Phase.STAGING:
            p.stage_s = time.monotonic() - p.t0
        if not all(r.get("ok", True) for r in p.reports.values()):
            self._finish(p, self._ordered(p), kept=not p.touched)  # kept: served weights never written
            return
        p.window = False
        if p.phase is Phase.OPEN:
            self._apply(p, drain_s=p.drain_s)
        else:
            p.phase = Phase.GATE

    def _ordered(self, p: Pending) -> list[dict]:
        return [p.reports[r] for r in sorted(p.reports)]

    def _progress(self) -> None:
        p = self.pending
        if p is None:
            return
        now = time.monotonic()
        if p.phase in (Phase.STAGING, Phase.OPEN):
            if now > p.t0 + p.cmd.timeout_s:
                self._finish(p, [], error=f"the staged receive did not finish within {p.cmd.timeout_s:g}s",
                             kept=p.phase is Phase.STAGING)
            return
        if p.gate_t0 is None:
            p.gate_t0 = now
        running = self._running()
        to = p.cmd.args["version"]
        if running:
            if p.crossing is Crossing.FINISH:
                if now - p.gate_t0 < self.serving.commit_wait_s:
                    return  # keep stepping them; new requests wait
                p.crossed = self._end_running(Aborted(
                    f"request aborted: it did not finish within commit_wait_s={self.serving.commit_wait_s:g}s "
                    f"before weight version {to} was committed; retry it (it runs on version {to})"))
            elif p.crossing is Crossing.ABORT:
                p.crossed = self._end_running(Aborted(
                    f"request aborted by weight update to version {to} (crossing policy 'abort'); retry it"))
            else:  # span: they go on, on fresh caches
                p.crossed = len(running)
                self._refill.update(s.sid for s in running)
        if p.window:
            self._open(p, drain_s=now - p.gate_t0)
        else:
            self._apply(p, drain_s=now - p.gate_t0)

    def _open(self, p: Pending, *, drain_s: float) -> None:
        """Pause the engine and let every worker's window receive write the served weights."""
        p.phase, p.open_t0, p.drain_s = Phase.OPEN, time.monotonic(), drain_s
        try:
            self.fanout.run(Op.OPEN, {}, 60.0)
        except BaseException as e:
            self._failed(e)
            self._finish(p, [], error=f"{type(e).__name__}: {e}", exc=e)

    def _apply(self, p: Pending, *, drain_s: float) -> None:
        """Change the weights between two steps: the commit (staged) or the whole receive."""
        t0 = time.monotonic()
        facts, commit_s = None, 0.0
        try:
            if p.staged:
                commits = self.fanout.run(Op.COMMIT, {}, 60.0)
                reports = self._ordered(p)
                facts = self.worker.staging_facts
                assert facts is not None, "a staged update on a worker without staging"
                commit_s = max(c["commit_s"] for c in commits)
            else:
                p.cmd.started.set_result(None)
                reports = self.fanout.run(p.cmd.kind, p.cmd.args, p.cmd.timeout_s)
        except BaseException as e:
            self._failed(e)
            self._finish(p, [], error=f"{type(e).__name__}: {e}", exc=e)
            return
        served = Served(staging=Staging(facts.mode) if facts else Staging.IN_PLACE,
                        staging_bytes=facts.nbytes if facts else 0, shard_bytes=facts.shard_bytes if facts else 0,
                        stage_s=p.stage_s, drain_s=drain_s, commit_s=commit_s, crossed=p.crossed,
                        pause_s=time.monotonic() - (p.open_t0 or t0))  # a window: from the pause on
        self._finish(p, reports, served=served)

    def _finish(self, p: Pending, reports: list[dict], *, error: str | None = None, kept: bool = False,
                served: Served | None = None, exc: BaseException | None = None) -> None:
        mode = UPDATES[p.cmd.kind] or p.cmd.args["mode"]
        res = UpdateResult.of(p.cmd.args["version"], mode, reports, error=error, served=served)
        res = self.session.settle(res, kept=kept)
        self.pending = None
        if not res.ok:
            log.warning("update %d failed (%s): %s", res.version,
                        "engine stale" if self.session.stale else "served weights kept", res.error)
            if self.session.stale:
                self._end_running(Stale(self.session.stale_message()))
        if not p.cmd.started.done():
            p.cmd.started.set_result(None)
        if exc is not None:
            p.cmd.future.set_exception(exc)
        else:
            p.cmd.future.set_result((res, self.session.version))
        deferred, self.deferred = self.deferred, []
        for cmd in deferred:
            self._accept(cmd)
