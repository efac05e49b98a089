"""The reference engine's weight-update service: session, command fan-out and store
listener behind plain methods (no web framework; ``server.py`` is the HTTP edge).

Long operations return a ``Future``; refusals raise ``control.session`` errors before any
weight is touched.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

from shardsync.control.listener import StoreListener
from shardsync.control.session import Conflict, Invalid, NotFound
from shardsync.control.wire import (
    BeginRequest,
    ConnectRequest,
    InfoResponse,
    PullRequest,
    VersionResponse,
)
from shardsync.engine.dispatch import Dispatcher
from shardsync.receiver import check_connect
from shardsync.receiver.connect import spec_to_dict
from shardsync.runtime.checksum import combine
from shardsync.runtime.ledger import UpdateResult
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.vocab import Op

UPDATE_TIMEOUT_S = 3600.0
REACH_S = 5.0  # how long a join may take to reach the trainer's store before it is refused


class Begun(NamedTuple):
    started: Future
    result: Future


def _then(fut: Future, fn) -> Future:
    """A future of ``fn(fut.result())`` (exceptions pass through)."""
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as e:
            out.set_exception(e)

    fut.add_done_callback(done)
    return out


class WeightService:
    def __init__(self, dispatcher: Dispatcher, *, facts: dict | None = None, secret: str,
                 delta_root: str | None = None) -> None:
        self.dispatcher, self.session = dispatcher, dispatcher.session
        self.facts = dict(facts or {})  # advertised engine facts (a test stand-in; see launch.py)
        self.secret = secret
        self.delta_root = Path(delta_root).resolve() if delta_root else None
        self.worker = dispatcher.worker
        self._results: dict[int, Future] = {}
        self._listener: StoreListener | None = None

    def info(self) -> InfoResponse:
        return InfoResponse(spec=spec_to_dict(self.worker.spec), tp=self.worker.tp, ep=self.worker.ep,
                            dtype=self.worker.dtype, weight_version=self.session.version, stale=self.session.stale,
                            lora=self.worker.views.lora,
                            **{"quantization": self.worker.views.quantization, **self.facts})

    def version(self) -> VersionResponse:
        return VersionResponse(weight_version=self.session.version, stale=self.session.stale,
                               connected=self.session.connected)

    def connect(self, req: ConnectRequest) -> dict[str, Any]:
        fingerprints = check_connect(req, self.worker.spec, self.worker.tp, self.worker.dtype, self.worker.ep,
                                     staging=self.worker.receiver.unpushable, views=self.worker.views)
        self.session.offer(req, fingerprints)
        return {"ok": True, "fingerprints": fingerprints}

    def join(self) -> Future:
        """Every TP worker joins the offered sync group; then its control starts.  An
        unreachable rendezvous is refused here, before the workers (and serving) wait on it."""
        req = self.session.take_offer()
        rdv = Rendezvous(**req.rendezvous.model_dump())
        try:
            open_store(dataclasses.replace(rdv, timeout_s=min(REACH_S, rdv.timeout_s)), is_master=False)
        except Exception as e:
            raise Conflict(f"cannot reach the trainer's rendezvous {rdv.host}:{rdv.port} within "
                           f"{min(REACH_S, rdv.timeout_s):g}s ({type(e).__name__}); connection unchanged") from None
        timeout = req.rendezvous.timeout_s + 30
        fut = self.dispatcher.submit(Op.JOIN, {"req": req.model_dump(mode="json")}, wait_s=timeout,
                                     timeout_s=timeout)

        def joined(out: tuple) -> dict:
            ranks, _ = out
            self.session.joined(req)
            self._stop_listener()
            if req.control == "store":
                self._listener = StoreListener(rdv, req.engine_index, self.begin, self.secret, refuse=self.refuse)
                self._listener.start()
            return {"ok": True, "sync_ranks": [r["sync_rank"] for r in ranks]}

        return _then(fut, joined)

    def begin(self, req: BeginRequest) -> Begun:
        """Validate and queue one update.  ``started`` resolves when the workers are ready to
        receive (after any command already running); ``result`` is its ``UpdateResult``."""
        update = self.session.begin(req)
        cmd = self.dispatcher.command(Op.UPDATE, {"version": update.version, "mode": update.mode,
                                                 "crossing": req.crossing}, timeout_s=UPDATE_TIMEOUT_S)
        result = _then(cmd.future, lambda out: out[0])
        self._results = {update.version: result}
        return Begun(cmd.started, result)

    def refuse(self, req: BeginRequest) -> Future:
        """Answer a refused pipelined begin through the transport (``BeginRequest.pipelined``)."""
        return self.dispatcher.submit(Op.REFUSE, {"mode": req.mode}, timeout_s=UPDATE_TIMEOUT_S)

    def finish(self, version: int) -> Future:
        self.session.in_progress(version)
        result = self._results.get(version)
        if result is None:
            raise NotFound(f"no update {version} was begun")
        return result

    def pull(self, req: PullRequest) -> Future:
        """A disk delta: only from under ``delta_root``, only a newer version, only a manifest
        whose stage files are plain names in its own directory."""
        from shardsync.delta.disk import read_manifest

        if self.delta_root is None:
            raise Conflict("this engine was started without --delta-root: it pulls from no directory")
        root = Path(req.root).resolve()
        if not root.is_relative_to(self.delta_root):
            raise Conflict(f"{req.root} is outside this engine's delta root {self.delta_root}")
        if req.version <= self.session.version:
            raise Conflict(f"version {req.version} is not newer than the engine's {self.session.version}")
        try:
            manifest = read_manifest(root, req.version)
        except FileNotFoundError as e:
            raise NotFound(str(e)) from None
        except ValueError as e:
            raise Invalid(str(e)) from None
        update = self.session.begin_pull(req.version, manifest["base_version"])
        fut = self.dispatcher.submit(Op.PULL, {"root": str(root), "version": update.version,
                                              "current": update.base_version}, timeout_s=UPDATE_TIMEOUT_S)
        return _then(fut, lambda out: out[0])

    def disconnect(self) -> Future:
        self.session.disconnect()
        self._stop_listener()
        return self.dispatcher.submit(Op.DISCONNECT, {})

    def checksum(self) -> Future:
        def sums(out: tuple) -> dict:
            parts, version = out
            return {"weight_version": version, "stale": self.session.stale,
                    "checksums": {k: (None if v is None else str(v)) for k, v in combine(parts).items()}}

        return _then(self.dispatcher.submit(Op.CHECKSUM, {}), sums)

    def _stop_listener(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    def last(self) -> UpdateResult | None:
        return self.session.last
