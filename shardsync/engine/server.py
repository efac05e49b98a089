"""HTTP API of the reference engine (FastAPI), served by TP worker 0.

The only module that maps errors to status codes: bad input -> 400/413/422, wrong
fingerprint/version/state -> 409, stale or busy -> 503.  A rejected update never
touches the weights; a failed one leaves the engine stale until the next full update.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from shardsync.engine.control import StoreControl
from shardsync.engine.dispatch import BusyError, Dispatcher, StaleError, WorkerError
from shardsync.engine.protocol import (
    PROTOCOL_VERSION,
    BeginRequest,
    ConnectRequest,
    FinishRequest,
    GenerateRequest,
    GenerateResponse,
    Generation,
    InfoResponse,
    LogprobsRequest,
    LogprobsResponse,
    PullRequest,
    UpdateResult,
    VersionResponse,
)
from shardsync.engine.worker import spec_to_dict, topology_from_connect
from shardsync.runtime.checksum import combine

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 2**20


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class EngineState:
    """Weight version and sync state; mutated only by handlers under ``lock``."""

    pending: dict | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)
    updates: dict[int, tuple[str, Future]] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    last: UpdateResult | None = None
    control: StoreControl | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, key: str, by: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0.0) + by


def create_app(dispatcher: Dispatcher, *, request_wait_s: float = 60.0) -> FastAPI:
    worker = dispatcher.worker
    state = EngineState()
    app = FastAPI(title="shardsync reference engine")
    app.state.engine = state

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        size = request.headers.get("content-length")
        if size is not None and int(size) > MAX_BODY_BYTES:
            return JSONResponse({"error": f"request body over {MAX_BODY_BYTES} bytes"}, status_code=413)
        return await call_next(request)

    async def run(kind: str, args: dict, *, wait_s: float | None = request_wait_s,
                  timeout_s: float = 300.0):
        try:
            fut = dispatcher.submit(kind, args, wait_s=wait_s, timeout_s=timeout_s)
            return await asyncio.wrap_future(fut)
        except BusyError as e:
            raise ApiError(503, str(e)) from None
        except StaleError as e:
            raise ApiError(503, stale_message(str(e))) from None
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except WorkerError as e:
            dispatcher.stale, dispatcher.stale_reason = True, f"worker failure: {e}"
            raise ApiError(503, f"engine worker failure: {e}") from None

    def stale_message(reason: str) -> str:
        return (f"engine weights are stale ({reason}); it serves again after the next full "
                "weight update")

    def serving_version() -> None:
        if dispatcher.stale:
            raise ApiError(503, stale_message(dispatcher.stale_reason))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "stale" if dispatcher.stale else "ok",
                "weight_version": dispatcher.version, "stale": dispatcher.stale}

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        serving_version()
        t0 = time.perf_counter()
        outs, version = await run("generate", req.model_dump())
        outs = outs[0]
        state.count("generate_requests_total")
        state.count("generated_tokens_total", sum(len(t) for t, _ in outs))
        state.count("generate_seconds_total", time.perf_counter() - t0)
        return GenerateResponse(outputs=[Generation(tokens=t, logprobs=lp) for t, lp in outs],
                                weight_version=version)

    @app.post("/logprobs", response_model=LogprobsResponse)
    async def logprobs(req: LogprobsRequest) -> LogprobsResponse:
        serving_version()
        out, version = await run("score", req.model_dump())
        out = out[0]
        state.count("logprobs_requests_total")
        return LogprobsResponse(logprobs=out, weight_version=version)

    @app.get("/weights/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(weight_version=dispatcher.version, stale=dispatcher.stale,
                               connected=bool(state.fingerprints))

    @app.get("/weights/info", response_model=InfoResponse)
    async def info() -> InfoResponse:
        return InfoResponse(spec=spec_to_dict(worker.spec), tp=worker.tp,
                            dtype=str(worker.model.dtype).removeprefix("torch."),
                            weight_version=dispatcher.version, stale=dispatcher.stale)

    @app.post("/weights/connect")
    async def connect(req: ConnectRequest) -> dict:
        """Plan exchange: rebuild the trainer's topology here and compare plan fingerprints."""
        if req.protocol != PROTOCOL_VERSION:
            raise ApiError(409, f"protocol {req.protocol} != engine protocol {PROTOCOL_VERSION}")
        raw = req.model_dump()
        try:
            topo = topology_from_connect(raw, str(worker.model.dtype).removeprefix("torch."))
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"cannot build the sync topology: {e}") from None
        if topo.spec.replace(name=worker.spec.name) != worker.spec.replace(dtype=topo.spec.dtype):
            raise ApiError(409, f"trainer model {topo.spec.name} differs from this engine's "
                                f"{worker.spec.name}: sync needs identical architectures")
        if req.engine_index >= len(req.engines) or req.engines[req.engine_index] != worker.tp:
            raise ApiError(409, f"engine {req.engine_index} declared with TP "
                                f"{req.engines[req.engine_index] if req.engine_index < len(req.engines) else '?'}"
                                f", this engine runs TP {worker.tp}")
        mine = {}
        for mode, fp in req.fingerprints.items():
            if mode not in ("p2p", "broadcast"):
                raise ApiError(400, f"unknown mode {mode!r} in fingerprints")
            try:
                mine[mode] = topo.fingerprint(mode)
            except ValueError as e:
                raise ApiError(409, f"{mode} plan cannot be built here: {e}") from None
            if mine[mode] != fp:
                raise ApiError(409, f"{mode} plan fingerprint mismatch: trainer {fp}, engine {mine[mode]}; "
                                    "trainer and engine disagree on the layouts")
        with state.lock:
            state.pending = raw | {"fingerprints": mine}
        return {"ok": True, "fingerprints": mine}

    @app.post("/weights/join")
    async def join() -> dict:
        """Rendezvous: every TP worker joins the sync group (blocks until all members are in)."""
        with state.lock:
            pending = state.pending
        if pending is None:
            raise ApiError(409, "no accepted /weights/connect to join")
        timeout = pending["rendezvous"]["timeout_s"] + 30
        ranks, _ = await run("join", {"req": pending}, wait_s=timeout, timeout_s=timeout)
        with state.lock:
            state.fingerprints = pending["fingerprints"]
            state.pending = None
        start_control(pending)
        return {"ok": True, "sync_ranks": [r["sync_rank"] for r in ranks]}

    def begin_update(req: BeginRequest) -> dict:
        """Validate and queue one update (HTTP begin and the store control share it)."""
        with state.lock:
            if not state.fingerprints:
                raise ApiError(409, "not connected: call /weights/connect and /weights/join first")
            plan_mode = req.mode.removeprefix("delta-")
            expected = state.fingerprints.get(plan_mode)
            if expected != req.fingerprint:
                raise ApiError(409, f"{req.mode} plan fingerprint {req.fingerprint} does not match the "
                                    f"connected plan {expected}; weights unchanged")
            if req.version < dispatcher.version:
                raise ApiError(409, f"version {req.version} is older than the engine's "
                                    f"{dispatcher.version}; weights unchanged")
            if req.mode.startswith("delta-"):
                if req.base_version is None:
                    raise ApiError(422, "a delta update needs base_version")
                if dispatcher.stale or req.base_version != dispatcher.version:
                    raise ApiError(409, f"delta against version {req.base_version} refused: this engine "
                                        f"holds version {dispatcher.version}"
                                        f"{' (stale)' if dispatcher.stale else ''}; send a full update")
            if any(not f.done() for _, f in state.updates.values()):
                raise ApiError(409, "another update is in progress")
            timeout = 3600.0
            fut = dispatcher.submit("update", {"version": req.version, "mode": req.mode},
                                    timeout_s=timeout)
            state.updates = {req.version: (req.mode, fut)}
        return {"accepted": True, "version": req.version}

    def update_entry(version: int) -> tuple[str, Future]:
        with state.lock:
            entry = state.updates.get(version)
        if entry is None:
            raise ApiError(404, f"no update {version} was begun")
        return entry

    def settle(version: int, mode: str, outcome: Future | BaseException) -> UpdateResult:
        """The engine's result of a finished update: counters, ``last``, and on failure the
        sync connection is dropped (the dispatcher already marked the engine stale)."""
        try:
            if isinstance(outcome, BaseException):
                raise outcome
            results, _ = outcome.result()
            error = next((r["error"] for r in results if not r["ok"]), None)
        except Exception as e:
            results, error = [], f"{type(e).__name__}: {e}"
        with state.lock:
            if error is None:
                state.count(f"updates_total_{mode.replace('-', '_')}")
            else:  # the dispatcher marked the engine stale; the sync group is gone
                state.fingerprints = {}
                state.count("updates_failed_total")
            res = UpdateResult(
                version=version, mode=mode, ok=error is None, error=error,
                pack_s=max((r.get("pack_s", 0.0) for r in results), default=0.0),
                transfer_s=max((r.get("transfer_s", 0.0) for r in results), default=0.0),
                unpack_s=max((r.get("unpack_s", 0.0) for r in results), default=0.0),
                total_s=max((r.get("total_s", 0.0) for r in results), default=0.0),
                bytes_received=sum(r.get("bytes_received", 0) for r in results),
                changed=sum(r.get("changed", 0) for r in results),
                buffer_bytes=max((r.get("buffer_bytes", 0) for r in results), default=0),
                buckets=sum(r.get("buckets", 0) for r in results),
            )
            state.last = res
            if res.ok:
                state.count("update_seconds_total", res.total_s)
                state.count("update_bytes_total", res.bytes_received)
        return res

    @app.post("/weights/begin", status_code=202)
    async def begin(req: BeginRequest) -> dict:
        return begin_update(req)

    @app.post("/weights/finish", response_model=UpdateResult)
    async def finish(req: FinishRequest) -> UpdateResult:
        mode, fut = update_entry(req.version)
        try:
            await asyncio.wrap_future(fut)
        except Exception as e:
            outcome: Future | BaseException = e
        else:
            outcome = fut
        res = settle(req.version, mode, outcome)
        if not res.ok:
            raise ApiError(503, f"update {req.version} failed: {res.error}; the engine refuses "
                                "generation until a full update")
        return res

    def start_control(pending: dict) -> None:
        """With ``control="store"``, begin/finish arrive through the sync group's store."""
        stop_control()
        if pending.get("control") == "store":
            state.control = StoreControl(pending, begin=begin_update, entry=update_entry, settle=settle)
            state.control.start()

    def stop_control() -> None:
        if state.control is not None:
            state.control.stop()
            state.control = None

    @app.post("/weights/pull", response_model=UpdateResult)
    async def pull(req: PullRequest) -> UpdateResult:
        """Apply a delta version from a shared directory (delta over disk; no sync group)."""
        from shardsync.delta.disk import read_manifest

        try:
            manifest = read_manifest(req.root, req.version)
        except FileNotFoundError as e:
            raise ApiError(404, str(e)) from None
        if dispatcher.stale or manifest["base_version"] != dispatcher.version:
            raise ApiError(409, f"version {req.version} is a delta against {manifest['base_version']}; this "
                                f"engine holds {dispatcher.version}{' (stale)' if dispatcher.stale else ''}; "
                                "send a full update")
        args = {"root": req.root, "version": req.version, "current": dispatcher.version}
        try:
            results, _ = await asyncio.wrap_future(dispatcher.submit("pull", args, timeout_s=3600.0))
        except Exception as e:
            raise ApiError(503, f"pull of version {req.version} failed: {e}; engine stale") from None
        error = next((r["error"] for r in results if not r["ok"]), None)
        if error is not None:
            state.count("updates_failed_total")
            raise ApiError(503, f"pull of version {req.version} failed: {error}; the engine refuses "
                                "generation until a full update")
        state.count("updates_total_delta_disk")
        res = UpdateResult(version=req.version, mode="delta-disk", ok=True,
                           unpack_s=max(r["unpack_s"] for r in results),
                           total_s=max(r["total_s"] for r in results),
                           bytes_received=sum(r["bytes_received"] for r in results),
                           changed=sum(r["changed"] for r in results))
        state.last = res
        return res

    @app.post("/weights/disconnect")
    async def disconnect() -> dict:
        """A trainer leaving: drop the sync group and any mapped trainer memory (weights kept)."""
        with state.lock:
            if any(not f.done() for _, f in state.updates.values()):
                raise ApiError(409, "an update is in progress; finish it first")
            state.fingerprints, state.pending = {}, None
        stop_control()
        await run("disconnect", {})
        return {"ok": True}

    @app.get("/weights/checksum")
    async def checksum() -> dict:
        parts, version = await run("checksum", {})
        sums = combine(parts)
        return {"weight_version": version, "stale": dispatcher.stale,
                "checksums": {k: (None if v is None else str(v)) for k, v in sums.items()}}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> str:
        lines = [
            "# TYPE shardsync_weight_version gauge", f"shardsync_weight_version {dispatcher.version}",
            "# TYPE shardsync_stale gauge", f"shardsync_stale {int(dispatcher.stale)}",
        ]
        for key, value in sorted(state.counters.items()):
            lines += [f"# TYPE shardsync_{key} counter", f"shardsync_{key} {value:g}"]
        if state.last is not None:
            for phase in ("pack_s", "transfer_s", "unpack_s", "total_s"):
                lines.append(f'shardsync_last_update_seconds{{phase="{phase[:-2]}"}} '
                             f"{getattr(state.last, phase):.6f}")
        return "\n".join(lines) + "\n"

    return app
