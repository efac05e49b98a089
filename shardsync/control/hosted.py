"""The trainer's client of engines that host shardsync's receiver behind their own endpoints
(vLLM, SGLang): their HTTP answers carry no results, so every engine rank writes its report
into the sync group's store (``receiver.hosted``), signed, and rank 0 reads them there.

An engine kind says how to open, feed and close one update session through its endpoints
(``start``, ``send``, ``end``, ``close_session``); the reports, the success rule (every rank
ok, else the engine stays paused on its previous version) and checksums are shared here.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from shardsync.control.client import SyncError, UpdateChannel, heartbeats
from shardsync.control.wire import (
    BeginRequest,
    ChecksumResponse,
    ConnectRequest,
    Joined,
    RankSums,
    VersionResponse,
)
from shardsync.mode import Mode
from shardsync.runtime.checksum import combine
from shardsync.runtime.ledger import RankReport, UpdateResult
from shardsync.store.keys import Keys
from shardsync.store.liveness import Watch
from shardsync.store.sealed import get

UPDATE_FAILED = "shardsync update failed"  # how a rank's failed receive starts its error
LAYOUT_MISMATCH = "parameters are not shardsync's engine layout"  # a refused connect says why


def weight_version(raw: object) -> int:
    """An engine's weight version as vLLM and SGLang report it: a string, ``"default"``
    before any update (0)."""
    try:
        return int(str(raw))
    except ValueError:
        return 0


def canonical(body: object) -> str:
    """The one JSON text of ``body`` that is signed and checked (keys sorted, no spaces)."""
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


def connect_body(connect: dict) -> str:
    """A connect request as signed and as checked."""
    return canonical(connect)


def call_body(name: str, call: dict, expires: float) -> str:
    """One update call of sync ``name`` with its expiry, as signed and as checked (the name
    binds it to its connection, the expiry to its time)."""
    return canonical({"name": name, "call": call, "expires": expires})


class HostedEngines:
    """Trainer rank 0's client of every engine of one hosted kind (the surface of
    ``control.Engines``).  Subclasses speak the engine's endpoints."""

    kind = "hosted"
    name = "the engine"  # in messages a user reads
    # crossing policy (ControlConfig.crossing) -> the engine's pause mode; REFUSED says why not
    PAUSE: dict[str, str] = {}
    REFUSED: dict[str, str] = {}
    DEFAULT_CROSSING = "finish"

    @classmethod
    def pause_mode_for(cls, crossing: str | None) -> str:
        crossing = crossing or cls.DEFAULT_CROSSING
        if crossing not in cls.PAUSE:
            raise ValueError(f"{cls.name} cannot serve crossing={crossing!r}: {cls.REFUSED.get(crossing, 'unknown')}; "
                             f"use one of {sorted(cls.PAUSE)} (or None: {cls.DEFAULT_CROSSING})")
        return cls.PAUSE[crossing]

    def __init__(self, urls: Sequence[str], update_timeout_s: float, token: str) -> None:
        self.urls, self.secret, self.update_timeout_s = list(urls), token, update_timeout_s
        self.requests: list[ConnectRequest] = []
        self.store: dist.Store | None = None
        self.keys: Keys | None = None
        self.seq = 0  # updates and checks on this connection (store keys)
        self._watching: tuple[list[ConnectRequest], Watch] | None = None

    # -- what an engine kind provides --

    def start(self) -> None:
        """Pause generation and open an update session on every engine."""
        raise NotImplementedError

    def send(self, info: dict) -> None:
        """Hand every engine one call (returns once every rank ran it)."""
        raise NotImplementedError

    def end(self, version: int) -> None:
        """Every rank succeeded: the engine takes ``version`` and generates again."""
        raise NotImplementedError

    def close_session(self) -> None:
        """End the update session without a version, leaving the engine paused."""
        raise NotImplementedError

    def versions(self) -> list[VersionResponse]:
        raise NotImplementedError

    def checksum_round(self, info: dict) -> None:
        """Run ``info`` (op checksum) on every rank without changing a weight."""
        raise NotImplementedError

    # -- shared --

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.update_timeout_s)

    def bind(self, store: dist.Store, keys: Keys) -> None:
        self.store, self.keys, self.seq, self._watching = store, keys, 0, None

    def _bound(self) -> tuple[dist.Store, Keys]:
        """The sync's store and keys (``WeightSync`` binds them before the connect)."""
        assert self.store is not None and self.keys is not None, "bind() runs before the connect"
        return self.store, self.keys

    def engine_ranks(self, i: int) -> int:
        """Engine ``i``'s ranks (TP x PP stages), as its connect request declares them."""
        return self.requests[i].ranks_of(i)

    def watch(self) -> Watch:
        """The joined ranks' heartbeats (one watch per connect: it remembers when each last beat)."""
        store, keys = self._bound()
        if self._watching is None or self._watching[0] is not self.requests:
            self._watching = (self.requests, heartbeats(store, keys, self.requests, self.urls))
        return self._watching[1]

    def ranks(self):
        """(engine index, rank) of every engine rank."""
        return [(i, r) for i in range(len(self.requests)) for r in range(self.engine_ranks(i))]

    def joined(self) -> bool:
        """Every rank's join note: whether any reported an update session left open."""
        store, keys = self._bound()
        return any(get(store, keys.rank_joined(i, r), Joined, self._timeout, self.secret).session_open
                   for i, r in self.ranks())

    def update_info(self, version: int, mode: Mode, **extra) -> dict:
        return {"seq": self.seq, "version": version, "mode": mode.value, **extra}

    def results(self, version: int, mode: Mode) -> list[UpdateResult]:
        store, keys = self._bound()
        out = []
        for i in range(len(self.requests)):
            reports = [get(store, keys.rank_result(self.seq, i, r), RankReport, self._timeout, self.secret,
                           self.watch()) for r in range(self.engine_ranks(i))]
            out.append(UpdateResult.of(version, mode, reports))
        return out

    def settle(self, version: int, mode: Mode, paused_at: float | None = None) -> list[UpdateResult]:
        """Every rank's report; on success the engines move to ``version`` and resume, on any
        failure they stay paused on their previous weights (``SyncError`` says which rank).
        ``paused_at`` (``time.monotonic`` when the engines answered the pause): each result's
        ``pause_s`` is the window until they answered the resume, as this client saw it (the
        engines do not report their pause)."""
        try:
            results = self.results(version, mode)
        except Exception as err:
            self.close_session_quietly()
            raise SyncError(f"{self.name} update {version}: no report from every rank ({err}); {self.name} "
                            "stays paused until a full update succeeds") from None
        bad = next((r for r in results if not r.ok), None)
        if bad is not None:
            self.close_session_quietly()
            raise SyncError(f"{bad.error}; {self.name} stays paused until a full update succeeds")
        self.end(version)
        if paused_at is None:
            return results
        paused = time.monotonic() - paused_at
        return [r.model_copy(update={"pause_s": paused}) for r in results]

    def close_session_quietly(self) -> None:
        """``close_session``, when a failure is already being reported."""
        try:
            self.close_session()
        except Exception:  # the engine may be gone too; the next connect closes what is left
            pass

    def channel(self) -> HostedChannel:
        return HostedChannel(self)

    def pull(self, root: str, version: int) -> list[UpdateResult]:
        """A disk delta: one round whose receive reads the published parts."""
        self.seq += 1
        self.start()
        paused_at = time.monotonic()
        self.send(self.update_info(version, Mode.DELTA_DISK, root=root))  # the manifest names its base
        return self.settle(version, Mode.DELTA_DISK, paused_at)

    def checksums(self) -> list[ChecksumResponse]:
        """Each rank's checksums of what it holds (a round that changes no weight)."""
        self.seq += 1
        version = self.versions()[0].weight_version
        self.checksum_round(self.update_info(version, Mode.BROADCAST, op="checksum"))
        store, keys = self._bound()
        out = []
        for i in range(len(self.requests)):
            parts = [get(store, keys.rank_checksums(self.seq, i, r), RankSums, self._timeout,
                         self.secret, self.watch()).keyed() for r in range(self.engine_ranks(i))]
            sums = {k: (None if v is None else str(v)) for k, v in combine(parts).items()}
            out.append(ChecksumResponse(weight_version=version, stale=False, checksums=sums))
        return out


class HostedChannel(UpdateChannel):
    """Begin and finish of one update on every hosted engine (``control.UpdateChannel``):
    the engines' receive call runs in the background while the trainer ranks send."""

    def __init__(self, engines: HostedEngines) -> None:
        self.engines = engines
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"{engines.kind}-update")
        self._sending: Future | None = None
        self._mode: Mode | None = None
        self._paused_at: float | None = None

    def begin(self, req: BeginRequest) -> None:
        e = self.engines
        e.seq += 1
        e.start()
        self._paused_at = time.monotonic()
        info = e.update_info(req.version, Mode(req.mode), fingerprint=req.fingerprint, base_version=req.base_version)
        self._mode = Mode(req.mode)
        self._sending = self._pool.submit(e.send, info)  # returns once every rank received

    def finish(self, version: int) -> list[UpdateResult]:
        e = self.engines
        try:
            assert self._sending is not None and self._mode is not None, "begin() runs before finish()"
            self._sending.result(timeout=e.update_timeout_s + 30)
        except Exception as err:
            e.close_session_quietly()
            raise SyncError(f"{e.name} update {version} failed: {err}; {e.name} stays paused on its previous "
                            "weights until a full update succeeds") from None
        return e.settle(version, self._mode, self._paused_at)
