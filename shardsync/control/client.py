"""The trainer's control clients: trainer rank 0 talking to every engine.

``Engines`` makes the connect-time and occasional calls over HTTP (info, connect, join,
versions, pull, checksums, disconnect), every engine in parallel, each call bounded.  Each
update's begin/finish go through an ``UpdateChannel``: ``StoreChannel`` (keys in the sync
group's store; O(1) store operations per engine) or ``HttpChannel`` (two POSTs per engine).
"""

from __future__ import annotations

import datetime
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar, Protocol

import httpx
import torch.distributed as dist
from pydantic import BaseModel

from shardsync.control.wire import (
    Accepted,
    BeginRequest,
    ChecksumResponse,
    ConnectRequest,
    InfoResponse,
    VersionResponse,
)
from shardsync.runtime.ledger import UpdateResult
from shardsync.store.keys import Keys
from shardsync.store.liveness import Silent, Watch
from shardsync.store.sealed import get, put
from shardsync.vocab import Refused


class SyncError(RuntimeError):
    """An update or connect that did not complete; engines keep (or mark stale) their weights."""


class EngineClient(Protocol):
    """Trainer rank 0's client of every engine of one trainer, whoever hosts the receivers
    (the reference engine: ``Engines``; vLLM and SGLang: ``control.hosted``).  ``WeightSync``
    calls these and nothing else, in this order: ``info`` -> ``bind`` -> ``connect`` ->
    ``join`` -> ``channel`` once, then per update the channel's begin/finish and, as needed,
    ``versions``, ``pull``, ``checksums``; ``disconnect`` and ``close`` at the end."""

    urls: list[str]

    def info(self) -> list[InfoResponse]:
        """Every engine's facts (the trainer plans from these, never from its own config)."""
        ...

    def bind(self, store: dist.Store, keys: Keys) -> None:
        """The sync's store, before the connect: engines that answer through it read it there."""
        ...

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
        """Offer every engine its connect request (``requests[i]`` to engine ``i``)."""
        ...

    def join(self) -> None:
        """Every engine rank joins the sync group (returns once all did, bounded)."""
        ...

    def channel(self) -> UpdateChannel:
        """The begin/finish of each update on this connection."""
        ...

    def versions(self) -> list[VersionResponse]:
        ...

    def pull(self, root: str, version: int) -> list[UpdateResult]:
        """Every engine applies the disk delta ``version`` published under ``root``."""
        ...

    def checksums(self) -> list[ChecksumResponse]:
        ...

    def disconnect(self) -> None:
        ...

    def close(self) -> None:
        ...


def heartbeats(store: dist.Store, keys: Keys, requests: Sequence[ConnectRequest], urls: Sequence[str]) -> Watch:
    """Trainer rank 0's watch over every engine rank's heartbeat (each names its engine)."""
    return Watch(store, {keys.alive(i, r): f"engine {url} (rank {r})"
                         for i, (req, url) in enumerate(zip(requests, urls, strict=True))
                         for r in range(req.ranks_of(i))})


class Engines:
    """HTTP client of every engine of one trainer (used on trainer rank 0 only): an
    ``EngineClient`` of reference engines.  ``store_channel``: each update's begin/finish go
    through the sync group's store (``StoreChannel``) instead of two POSTs."""

    def __init__(self, urls: Sequence[str], timeout_s: float, token: str | None, *,
                 keepalive: bool = True, store_channel: bool = False) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s, self.token, self.store_channel = timeout_s, token, store_channel
        self.store: dist.Store | None = None
        self.keys: Keys | None = None
        self.watch: Watch | None = None  # the engines' heartbeats, from the connect on
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits() if keepalive else httpx.Limits(max_keepalive_connections=0)
        self._http = httpx.Client(timeout=timeout_s, headers=headers, limits=limits)

    def call(self, method: str, path: str, payloads: Sequence[BaseModel | dict | None] | None = None, *,
             timeout_s: float | None = None) -> list[dict]:
        """``method path`` on every engine (``payloads[i]`` to engine ``i``); ``SyncError`` on a
        status >= 400 naming the engine and its answer."""
        payloads = payloads or [None] * len(self.urls)
        extra = {} if timeout_s is None else {"timeout": timeout_s}

        def one(i: int) -> dict:
            return self.call_one(i, method, path, payloads[i], **extra)

        if len(self.urls) == 1:  # the common colocated case: no thread hop on the hot path
            return [one(0)]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            return list(pool.map(one, range(len(self.urls))))

    def call_one(self, i: int, method: str, path: str, body: BaseModel | dict | None = None, *,
                 timeout: float | None = None) -> dict:
        """``method path`` on engine ``i`` alone (``SyncError`` on a status >= 400)."""
        url = self.urls[i] + path
        if isinstance(body, BaseModel):
            body = body.model_dump(mode="json")
        r = self._http.request(method, url, json=body,
                               timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        if r.status_code >= 400:
            raise SyncError(f"{method} {url} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def info(self) -> list[InfoResponse]:
        return [InfoResponse.model_validate(r) for r in self.call("GET", "/weights/info")]

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
        if self.store is not None and self.keys is not None:
            self.watch = heartbeats(self.store, self.keys, requests, self.urls)
        self.call("POST", "/weights/connect", requests)

    def join(self) -> None:
        self.call("POST", "/weights/join")

    def versions(self) -> list[VersionResponse]:
        return [VersionResponse.model_validate(r) for r in self.call("GET", "/weights/version")]

    def pull(self, root: str, version: int) -> list[UpdateResult]:
        body = {"root": root, "version": version}
        return [UpdateResult.model_validate(r)
                for r in self.call("POST", "/weights/pull", [body] * len(self.urls))]

    def checksums(self) -> list[ChecksumResponse]:
        return [ChecksumResponse.model_validate(r) for r in self.call("GET", "/weights/checksum")]

    def disconnect(self) -> None:
        self.call("POST", "/weights/disconnect")

    def close(self) -> None:
        self._http.close()

    def bind(self, store: dist.Store, keys: Keys) -> None:
        self.store, self.keys = store, keys

    def channel(self) -> UpdateChannel:
        if not self.store_channel:
            return HttpChannel(self)
        if self.store is None or self.keys is None:
            raise SyncError("the store channel needs the sync's store: bind() it before channel()")
        if self.token is None:
            raise SyncError("the store channel signs its values: make the client with the engines' secret")
        return StoreChannel(self.store, self.keys, self.urls, self.timeout_s, self.token, self.watch)


class UpdateChannel:
    """Begin and finish of one update on every engine (trainer rank 0)."""

    # the begin's answers can be read after the transfer as well as before: the trainer may
    # send without waiting for them (with a program that ``answers_refusals``)
    pipelines: ClassVar[bool] = False

    def begin(self, req: BeginRequest) -> None:
        """Every engine accepted ``req``, or ``SyncError`` naming the first refusal (a channel
        with ``pipelines``: with ``req.pipelined`` the answers are checked at ``finish``)."""
        raise NotImplementedError

    def finish(self, version: int) -> list[UpdateResult]:
        """Every engine's result of the update just moved (``SyncError`` if one failed)."""
        raise NotImplementedError


def _check(urls: Sequence[str], version: int, results: list[UpdateResult]) -> list[UpdateResult]:
    bad = next(((u, r) for u, r in zip(urls, results, strict=True) if not r.ok), None)
    if bad is not None:
        raise SyncError(f"{bad[0]}: update {version} failed: {bad[1].error}; the engine refuses "
                        "generation until a full update")
    return results


class HttpChannel(UpdateChannel):
    """Two POSTs per engine and update (``/weights/begin``, ``/weights/finish``)."""

    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def begin(self, req: BeginRequest) -> None:
        self.engines.call("POST", "/weights/begin", [req] * len(self.engines.urls))

    def finish(self, version: int) -> list[UpdateResult]:
        out = self.engines.call("POST", "/weights/finish", [{"version": version}] * len(self.engines.urls))
        return [UpdateResult.model_validate(r) for r in out]


class StoreChannel(UpdateChannel):
    """Keys under the sync's name in its store; each engine's listener answers (``listener``)."""

    def __init__(self, store: dist.Store, keys: Keys, urls: Sequence[str], timeout_s: float,
                 secret: str, watch: Watch | None = None) -> None:
        self.store, self.keys, self.urls, self.secret, self.watch = store, keys, list(urls), secret, watch
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.seq = 0  # updates begun on this connection (the engines count from 1 too)

    def _get(self, key: str, model):
        try:
            return get(self.store, key, model, self.timeout, self.secret, self.watch)
        except Silent as e:
            raise SyncError(str(e)) from None
        except dist.DistStoreError:
            raise SyncError(f"no answer under {key} within {self.timeout.total_seconds()}s "
                            "(engine gone or stuck)") from None

    pipelines = True  # answers are keys
    _unchecked = False  # this update's answers are read at finish

    def begin(self, req: BeginRequest) -> None:
        self.seq += 1
        put(self.store, self.keys.begin(self.seq), req, self.secret)
        self._unchecked = req.pipelined
        if not req.pipelined:
            for i, url in enumerate(self.urls):
                answer = self._get(self.keys.accepted(self.seq, i), Accepted)
                if not answer.ok:
                    raise SyncError(f"{url} refused update {req.version}: {answer.error}")

    def finish(self, version: int) -> list[UpdateResult]:
        """``Refused`` (after the others' results) when an engine refused a pipelined begin."""
        taken: Sequence[int] = range(len(self.urls))
        refusals: list[str] = []
        if self._unchecked:
            answers = [self._get(self.keys.accepted(self.seq, i), Accepted) for i in taken]
            refusals = [f"{self.urls[i]} refused update {version}: {a.error}"
                        for i, a in enumerate(answers) if not a.ok]
            taken = [i for i, a in enumerate(answers) if a.ok]
        results = [self._get(self.keys.result(self.seq, i), UpdateResult) for i in taken]
        if refusals:
            raise Refused("; ".join(refusals))
        return _check(self.urls, version, results)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Return once the engine server at ``url`` answers ``/health``; raise if ``proc`` (the server
    process a launcher started) exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"engine {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine {url} not healthy after {timeout_s:.0f}s")
        time.sleep(0.3)
