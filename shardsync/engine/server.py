"""HTTP API of the reference engine (FastAPI), served by TP worker 0: the HTTP edge.

The only module that maps errors to status codes: bad input -> 400/413/422, wrong
fingerprint/version/state -> 409, unknown update -> 404, stale or busy -> 503.  What an
endpoint does lives in ``engine/updates.py`` (weights) and the workers (serving); a rejected
update never touches the weights, a failed one leaves the engine stale until a full update.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shardsync.control.session import Conflict, Invalid, NotConnected, NotFound, SessionError, Stale
from shardsync.control.wire import (
    BeginRequest,
    ChecksumResponse,
    ConnectRequest,
    FinishRequest,
    InfoResponse,
    PullRequest,
    VersionResponse,
)
from shardsync.engine.dispatch import Aborted, BusyError, Dispatcher, WorkerError
from shardsync.engine.protocol import (
    GenerateRequest,
    GenerateResponse,
    Generation,
    LogprobsRequest,
    LogprobsResponse,
    Span,
)
from shardsync.engine.served import ServingMetrics
from shardsync.engine.updates import WeightService
from shardsync.runtime.ledger import UpdateResult
from shardsync.store.auth import Forbidden, Unauthorized, check_bearer
from shardsync.vocab import Op

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 8 * 2**20

# typed errors -> status codes, most specific first
STATUS: tuple[tuple[type[BaseException], int], ...] = (
    (Unauthorized, 401), (Forbidden, 403), (Invalid, 422), (NotConnected, 409), (Conflict, 409), (NotFound, 404),
    (Stale, 503),
    (SessionError, 409), (BusyError, 503), (Aborted, 503), (WorkerError, 503), (ValueError, 400),
)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_of(e: BaseException) -> int | None:
    return next((code for kind, code in STATUS if isinstance(e, kind)), None)


async def wait(fut: Future):
    """The result of ``fut``; a typed error becomes an ``ApiError`` with its status."""
    try:
        return await asyncio.wrap_future(fut)
    except ApiError:
        raise
    except Exception as e:
        code = status_of(e)
        if code is None:
            raise
        message = f"engine worker failure: {e}" if isinstance(e, WorkerError) else str(e)
        raise ApiError(code, message) from None


def create_app(dispatcher: Dispatcher, *, request_wait_s: float = 60.0, facts: dict | None = None,
               token: str, delta_root: str | None = None) -> FastAPI:
    service = WeightService(dispatcher, facts=facts, secret=token, delta_root=delta_root)
    session = service.session
    # FastAPI counts the body as it streams in (a chunked body has no Content-Length) -> 413
    app = FastAPI(title="shardsync reference engine", max_body_size=MAX_BODY_BYTES)
    app.state.service = service

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        """422 naming each problem; the offending input is not echoed (it may not even be
        valid JSON to send back, e.g. NaN)."""
        problems = [{"loc": [str(x) for x in err.get("loc", ())], "msg": str(err.get("msg", "")),
                     "type": str(err.get("type", ""))} for err in e.errors()[:20]]
        return JSONResponse({"error": "invalid request: " + "; ".join(
            f"{'.'.join(p['loc'])}: {p['msg']}" for p in problems[:3]), "detail": problems}, status_code=422)

    @app.exception_handler(SessionError)
    async def _session_error(_: Request, e: SessionError) -> JSONResponse:
        return JSONResponse({"error": str(e)}, status_code=status_of(e) or 409)

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        """Every call that changes the engine (``POST /weights/*``) carries the shared secret."""
        if request.method != "GET" and request.url.path.startswith("/weights/"):
            try:
                check_bearer(request.headers.get("authorization"), token)
            except (Unauthorized, Forbidden) as e:
                return JSONResponse({"error": str(e)}, status_code=401 if isinstance(e, Unauthorized) else 403)
        return await call_next(request)


    assert session.metrics is not None, "the reference engine's session keeps its own collectors"
    registry = session.metrics.registry
    served = ServingMetrics(registry)

    def serve(kind: Op, args: dict) -> Future:
        try:
            return dispatcher.submit(kind, args, wait_s=request_wait_s)
        except BusyError as e:
            raise ApiError(503, str(e)) from None

    @app.get("/health")
    async def health() -> dict:
        return {"status": "stale" if session.stale else "ok", "weight_version": session.version,
                "stale": session.stale}

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(req: GenerateRequest) -> GenerateResponse:
        session.check_servable()
        t0 = time.perf_counter()
        outs, version = await wait(serve(Op.GENERATE, req.model_dump()))
        served.generated(time.perf_counter() - t0, sum(len(t) for t, _, _ in outs),
                         spanning=any(len(spans) > 1 for _, _, spans in outs))
        return GenerateResponse(outputs=[Generation(tokens=t, logprobs=lp,
                                                    spans=[Span(version=v, first=a, last=b) for v, a, b in spans])
                                         for t, lp, spans in outs], weight_version=version)

    @app.post("/logprobs", response_model=LogprobsResponse)
    async def logprobs(req: LogprobsRequest) -> LogprobsResponse:
        session.check_servable()
        out, version = await wait(serve(Op.SCORE, req.model_dump()))
        served.logprobs.inc()
        return LogprobsResponse(logprobs=out[0], weight_version=version)

    @app.get("/weights/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return service.version()

    @app.get("/weights/info", response_model=InfoResponse)
    async def info() -> InfoResponse:
        return service.info()

    @app.post("/weights/connect")
    async def connect(req: ConnectRequest) -> dict:
        """Plan exchange: rebuild the trainer's topology here and compare plan fingerprints."""
        return service.connect(req)

    @app.post("/weights/join")
    async def join() -> dict:
        """Rendezvous: every TP worker joins the sync group (blocks until all members are in)."""
        return await wait(service.join())

    @app.post("/weights/begin", status_code=202)
    async def begin(req: BeginRequest) -> dict:
        """Accepted once the workers are ready to receive (after a running command finishes)."""
        await wait(service.begin(req).started)
        return {"accepted": True, "version": req.version}

    @app.post("/weights/finish", response_model=UpdateResult)
    async def finish(req: FinishRequest) -> UpdateResult:
        res = await wait(service.finish(req.version))
        if not res.ok:
            raise ApiError(503, f"update {req.version} failed: {res.error}; the engine refuses "
                                "generation until a full update")
        return res

    @app.post("/weights/pull", response_model=UpdateResult)
    async def pull(req: PullRequest) -> UpdateResult:
        """Apply a delta version from a shared directory (delta over disk; no sync group)."""
        res = await wait(service.pull(req))
        if not res.ok:
            raise ApiError(503, f"pull of version {req.version} failed: {res.error}; the engine refuses "
                                "generation until a full update")
        return res

    @app.post("/weights/disconnect")
    async def disconnect() -> dict:
        """A trainer leaving: drop the sync group and any mapped trainer memory (weights kept)."""
        await wait(service.disconnect())
        return {"ok": True}

    @app.get("/weights/checksum", response_model=ChecksumResponse)
    async def checksum() -> dict:
        return await wait(service.checksum())

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text: the update collectors (``control/metrics.py``) and the serving ones."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app
