"""The engine's update session: one explicit state machine, shared by every front end.

States: ``idle`` (serving ``version``) -> ``receiving`` (an accepted update is running) ->
``idle`` on commit (serving the new version), or ``stale`` on failure (refuses to serve
until a full update commits).  A connection (the plan fingerprints of one trainer) is
offered at connect, made current at join, and dropped on disconnect or failure.

Errors are typed (``SessionError`` subclasses); only the HTTP edge maps them to status
codes.  Every method is thread-safe: HTTP handlers, the store listener and the engine's
command thread all call in.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum

from shardsync.control.metrics import UpdateMetrics
from shardsync.control.wire import BeginRequest, ConnectRequest
from shardsync.mode import Mode
from shardsync.runtime.ledger import UpdateResult


class State(str, Enum):
    IDLE = "idle"
    RECEIVING = "receiving"
    STALE = "stale"


class SessionError(Exception):
    """A request the session refuses; the weights are untouched."""


class Invalid(SessionError):
    """The request is malformed for this session (e.g. a delta without its base)."""


class NotConnected(SessionError):
    """No trainer connection to run the request on."""


class Conflict(SessionError):
    """The request disagrees with the session's state (plan, version, another update)."""


class NotFound(SessionError):
    """The request names an update that was never begun."""


class Stale(SessionError):
    """The weights are from a failed update; only a full update makes them servable."""


@dataclass
class Update:
    version: int
    mode: Mode
    base_version: int | None = None


@dataclass
class UpdateSession:
    """One engine's update state, whoever hosts it: the reference engine's server, and each
    rank of a vLLM or SGLang engine (``receiver.hosted``).  ``versions_grow``: an update older
    than the served version is refused (the reference engine tags every answer with its
    version); hosted engines leave version labels to the engine and only check delta bases."""

    version: int = 0
    state: State = State.IDLE
    stale_reason: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)  # of the current connection
    offered: ConnectRequest | None = None  # accepted at connect, not yet joined
    current: Update | None = None
    last: UpdateResult | None = None
    # Prometheus collectors (its own registry; a hosted engine's rank 0: the process's; None: none)
    metrics: UpdateMetrics | None = field(default_factory=UpdateMetrics)
    versions_grow: bool = True
    calls: int = 0  # the last call number taken on this connection (hosted ranks: a call never runs twice)
    _was_stale: bool = field(default=False, repr=False)  # receiving into stale weights
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def stale(self) -> bool:
        """Not servable: stale, or receiving the full update that repairs stale weights."""
        return self.state is State.STALE or (self.state is State.RECEIVING and self._was_stale)

    @property
    def connected(self) -> bool:
        return bool(self.fingerprints)

    def __post_init__(self) -> None:
        self._observed()

    def _observed(self) -> None:
        """The version and staleness gauges, after every change of either."""
        if self.metrics is not None:
            self.metrics.state(self.version, self.state is State.STALE)

    # -- serving --

    def check_servable(self) -> None:
        with self._lock:
            if self.stale:
                raise Stale(self.stale_message())

    def stale_message(self) -> str:
        return (f"engine weights are stale ({self.stale_reason}); it serves again after the next "
                "full weight update")

    # -- connection --

    def offer(self, req: ConnectRequest, fingerprints: dict[str, str]) -> None:
        """A connect whose plans matched this engine's: kept until ``joined``."""
        with self._lock:
            self.offered = req.model_copy(update={"fingerprints": fingerprints})

    def take_offer(self) -> ConnectRequest:
        with self._lock:
            if self.offered is None:
                raise NotConnected("no accepted /weights/connect to join")
            return self.offered

    def joined(self, req: ConnectRequest) -> None:
        with self._lock:
            self.fingerprints = dict(req.fingerprints)
            self.calls = 0
            if self.offered is req:
                self.offered = None

    def take_call(self, seq: int) -> None:
        """Call ``seq`` of this connection runs once, in order: an old or repeated number (a
        replay) is refused before anything runs."""
        with self._lock:
            if seq <= self.calls:
                raise Conflict(f"call {seq} after call {self.calls} on this connection (a replay?); ignored")
            self.calls = seq

    def disconnect(self) -> None:
        with self._lock:
            if self.state is State.RECEIVING:
                raise Conflict("an update is in progress; finish it first")
            self.fingerprints, self.offered = {}, None

    # -- one update --

    def begin(self, req: BeginRequest) -> Update:
        """Validate ``req`` against the connection and the weights; idle/stale -> receiving."""
        mode = Mode(req.mode)
        with self._lock:
            if not self.fingerprints:
                raise NotConnected("not connected: call /weights/connect and /weights/join first")
            expected = self.fingerprints.get(mode.plan.value)
            if expected != req.fingerprint:
                raise Conflict(f"{mode} plan fingerprint {req.fingerprint} does not match the "
                               f"connected plan {expected}; weights unchanged")
            if self.versions_grow and req.version < self.version:
                raise Conflict(f"version {req.version} is older than the engine's {self.version}; "
                               "weights unchanged")
            if mode.is_delta:
                if req.base_version is None:
                    raise Invalid("a delta update needs base_version")
                self._check_base(req.base_version)
            if self.state is State.RECEIVING:
                raise Conflict("another update is in progress")
            self._was_stale = self.state is State.STALE
            self.state = State.RECEIVING
            self.current = Update(req.version, mode, req.base_version)
            return self.current

    def begin_pull(self, version: int, base_version: int) -> Update:
        """A disk delta (no connection needed): its base must be what this engine serves."""
        with self._lock:
            self._check_base(base_version, what=f"version {version} is a delta against {base_version}")
            if self.state is State.RECEIVING:
                raise Conflict("another update is in progress")
            self._was_stale = False
            self.state = State.RECEIVING
            self.current = Update(version, Mode.DELTA_DISK, base_version)
            return self.current

    def _check_base(self, base: int, what: str | None = None) -> None:
        if self.state is State.STALE or base != self.version:
            what = what or f"delta against version {base} refused"
            raise Conflict(f"{what}: this engine holds version {self.version}"
                           f"{' (stale)' if self.state is State.STALE else ''}; send a full update")

    def in_progress(self, version: int) -> Update:
        with self._lock:
            if self.current is None or self.current.version != version:
                raise NotFound(f"no update {version} was begun")
            return self.current

    def settle(self, result: UpdateResult, *, kept: bool = False) -> UpdateResult:
        """receiving -> idle (committed) or stale (failed; the connection is dropped).  ``kept``:
        the failure never touched the served weights (a staged receive): back to what it was."""
        with self._lock:
            if self.state is not State.RECEIVING:
                return result  # settled already (HTTP finish and the store listener both report)
            mode = result.mode
            if result.ok:
                self.version, self.state, self.stale_reason = result.version, State.IDLE, ""
            elif kept and not self._was_stale:
                self.state = State.IDLE
            else:
                self.state, self.stale_reason = State.STALE, f"update {result.version} failed: {result.error}"
            if not result.ok and mode.over_group:
                self.fingerprints = {}  # the sync group is broken after a failed collective
            if self.metrics is not None:
                self.metrics.settled(result)
            self._observed()
            self.last = result
            return result

    def fail(self, reason: str) -> None:
        """Outside any update (a worker died): stale until a full update."""
        with self._lock:
            self.state, self.stale_reason = State.STALE, reason
            self._observed()
