"""The reference engine's weight-update service: session, command fan-out and store
listener behind plain methods (no web framework; ``server.py`` is the HTTP edge).

Long operations return a ``Future``; refusals raise ``control.session`` errors before any
weight is touched.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from shardsync.control.listener import StoreListener
from shardsync.control.session import NotFound
from shardsync.control.wire import (
    BeginRequest,
    ConnectRequest,
    InfoResponse,
    PullRequest,
    UpdateResult,
    VersionResponse,
)
from shardsync.engine.dispatch import Dispatcher
from shardsync.engine.worker import spec_dict
from shardsync.receiver import check_connect
from shardsync.runtime.checksum import combine
from shardsync.transport.group import Rendezvous

UPDATE_TIMEOUT_S = 3600.0


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
    def __init__(self, dispatcher: Dispatcher, *, facts: dict | None = None) -> None:
        self.dispatcher, self.session = dispatcher, dispatcher.session
        self.facts = dict(facts or {})  # advertised engine facts (a test stand-in; see launch.py)
        self.worker = dispatcher.worker
        self._results: dict[int, Future] = {}
        self._listener: StoreListener | None = None

    def info(self) -> InfoResponse:
        return InfoResponse(spec=spec_dict(self.worker.spec), tp=self.worker.tp, dtype=self.worker.dtype,
                            weight_version=self.session.version, stale=self.session.stale, **self.facts)

    def version(self) -> VersionResponse:
        return VersionResponse(weight_version=self.session.version, stale=self.session.stale,
                               connected=self.session.connected)

    def connect(self, req: ConnectRequest) -> dict[str, Any]:
        fingerprints = check_connect(req, self.worker.spec, self.worker.tp, self.worker.dtype)
        self.session.offer(req, fingerprints)
        return {"ok": True, "fingerprints": fingerprints}

    def join(self) -> Future:
        """Every TP worker joins the offered sync group; then its control starts."""
        req = self.session.take_offer()
        timeout = req.rendezvous.timeout_s + 30
        fut = self.dispatcher.submit("join", {"req": req.model_dump(mode="json")}, wait_s=timeout,
                                     timeout_s=timeout)

        def joined(out: tuple) -> dict:
            ranks, _ = out
            self.session.joined(req)
            self._stop_listener()
            if req.control == "store":
                self._listener = StoreListener(Rendezvous(**req.rendezvous.model_dump()), req.engine_index,
                                               self.begin)
                self._listener.start()
            return {"ok": True, "sync_ranks": [r["sync_rank"] for r in ranks]}

        return _then(fut, joined)

    def begin(self, req: BeginRequest) -> Future:
        """Validate and queue one update; the future's value is its ``UpdateResult``."""
        update = self.session.begin(req)
        fut = self.dispatcher.submit("update", {"version": update.version, "mode": update.mode.value},
                                     timeout_s=UPDATE_TIMEOUT_S)
        result = _then(fut, lambda out: out[0])
        self._results = {update.version: result}
        return result

    def finish(self, version: int) -> Future:
        self.session.in_progress(version)
        result = self._results.get(version)
        if result is None:
            raise NotFound(f"no update {version} was begun")
        return result

    def pull(self, req: PullRequest) -> Future:
        from shardsync.delta.disk import read_manifest

        try:
            manifest = read_manifest(req.root, req.version)
        except FileNotFoundError as e:
            raise NotFound(str(e)) from None
        update = self.session.begin_pull(req.version, manifest["base_version"])
        fut = self.dispatcher.submit("pull", {"root": req.root, "version": update.version,
                                              "current": update.base_version}, timeout_s=UPDATE_TIMEOUT_S)
        return _then(fut, lambda out: out[0])

    def disconnect(self) -> Future:
        self.session.disconnect()
        self._stop_listener()
        return self.dispatcher.submit("disconnect", {})

    def checksum(self) -> Future:
        def sums(out: tuple) -> dict:
            parts, version = out
            return {"weight_version": version, "stale": self.session.stale,
                    "checksums": {k: (None if v is None else str(v)) for k, v in combine(parts).items()}}

        return _then(self.dispatcher.submit("checksum", {}), sums)

    def _stop_listener(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    def last(self) -> UpdateResult | None:
        return self.session.last
