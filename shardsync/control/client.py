"""The trainer's control clients: trainer rank 0 talking to every engine.

``Engines`` makes the connect-time and occasional calls over HTTP (info, connect, join,
versions, pull, checksums, disconnect), every engine in parallel, each call bounded.  Each
update's begin/finish go through an ``UpdateChannel``: ``StoreChannel`` (keys in the sync
group's store; O(1) store operations per engine) or ``HttpChannel`` (two POSTs per engine).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import httpx
import torch.distributed as dist
from pydantic import BaseModel

from shardsync.control.wire import (
    Accepted,
    BeginRequest,
    ChecksumResponse,
    ConnectRequest,
    InfoResponse,
    Keys,
    Refused,
    UpdateResult,
    VersionResponse,
    get,
    put,
)


class SyncError(RuntimeError):
    """An update or connect that did not complete; engines keep (or mark stale) their weights."""


class Engines:
    """HTTP client of every engine of one trainer (used on trainer rank 0 only)."""

    def __init__(self, urls: Sequence[str], timeout_s: float, token: str | None = None, *,
                 keepalive: bool = True) -> None:
        self.urls = [u.rstrip("/") for u in urls]
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
        extra = {} if timeout is None else {"timeout": timeout}
        r = self._http.request(method, url, json=body, **extra)
        if r.status_code >= 400:
            raise SyncError(f"{method} {url} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def info(self) -> list[InfoResponse]:
        return [InfoResponse.model_validate(r) for r in self.call("GET", "/weights/info")]

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
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


class UpdateChannel(Protocol):
    """Begin and finish of one update on every engine (trainer rank 0)."""

    def begin(self, req: BeginRequest) -> None:
        """Every engine accepted ``req``, or ``SyncError`` naming the first refusal (a channel
        with ``pipelines``: with ``req.pipelined`` the answers are checked at ``finish``)."""
        ...

    def finish(self, version: int) -> list[UpdateResult]:
        """Every engine's result of the update just moved (``SyncError`` if one failed)."""
        ...


def _check(urls: Sequence[str], version: int, results: list[UpdateResult]) -> list[UpdateResult]:
    bad = next(((u, r) for u, r in zip(urls, results, strict=True) if not r.ok), None)
    if bad is not None:
        raise SyncError(f"{bad[0]}: update {version} failed: {bad[1].error}; the engine refuses "
                        "generation until a full update")
    return results


class HttpChannel:
    def __init__(self, engines: Engines) -> None:
        self.engines = engines

    def begin(self, req: BeginRequest) -> None:
        self.engines.call("POST", "/weights/begin", [req] * len(self.engines.urls))

    def finish(self, version: int) -> list[UpdateResult]:
        out = self.engines.call("POST", "/weights/finish", [{"version": version}] * len(self.engines.urls))
        return [UpdateResult.model_validate(r) for r in out]


class StoreChannel:
    """Keys under the sync's name in its store; each engine's listener answers (``listener``)."""

    def __init__(self, store: dist.Store, keys: Keys, urls: Sequence[str], timeout_s: float,
                 secret: str | None = None) -> None:
        self.store, self.keys, self.urls, self.secret = store, keys, list(urls), secret
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.seq = 0  # updates begun on this connection (the engines count from 1 too)

    def _get(self, key: str, model):
        try:
            return get(self.store, key, model, self.timeout, self.secret)
        except dist.DistStoreError:
            raise SyncError(f"no answer under {key} within {self.timeout.total_seconds()}s "
                            "(engine gone or stuck)") from None

    pipelines = True  # answers are keys: they can be read after the transfer as well as before
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
        taken = range(len(self.urls))
        refusals = []
        if self._unchecked:
            answers = [self._get(self.keys.accepted(self.seq, i), Accepted) for i in taken]
            refusals = [f"{self.urls[i]} refused update {version}: {a.error}" for i, a in enumerate(answers) if not a.ok]
            taken = [i for i, a in enumerate(answers) if a.ok]
        results = [self._get(self.keys.result(self.seq, i), UpdateResult) for i in taken]
        if refusals:
            raise Refused("; ".join(refusals))
        return _check(self.urls, version, results)

