"""The trainer's client of vLLM engines, through vLLM's own endpoints only.

vLLM (started with ``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config
'{"backend": "shardsync"}'``) exposes its weight-transfer lifecycle over HTTP; its answers
carry no results, so each worker writes its report into the sync group's store
(``engines.vllm.backend``).  Per update, O(1) calls per engine whatever the bucket count:
``/pause?mode=wait`` -> ``/start_weight_update`` -> ``/update_weights`` (runs while the
trainer sends) -> ``/finish_weight_update`` (the weight version) -> ``/resume``; a failed
update ends the session without a version and is never resumed: vLLM stays paused until
the next full update succeeds.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from shardsync.control import auth
from shardsync.control.client import Engines, SyncError
from shardsync.control.report import reduce_reports
from shardsync.control.wire import (
    BeginRequest,
    ChecksumResponse,
    ConnectRequest,
    InfoResponse,
    Joined,
    Keys,
    RankReport,
    RankSums,
    UpdateResult,
    VersionResponse,
    get,
)
from shardsync.mode import Mode
from shardsync.runtime.checksum import combine

MAC_KEY = "shardsync/vllm/connect"  # what the worker checks the connect's signature under
UPDATE_FAILED = "shardsync update failed"  # how a worker's failed receive starts its error
LAYOUT_MISMATCH = "vLLM's parameters are not shardsync's engine layout"  # a refused connect says why
ENV_LAYOUT = "SHARDSYNC_VLLM_LAYOUT"  # "whole" in vLLM's environment: always receive whole tensors


def connect_body(connect: dict) -> str:
    """The canonical JSON of a connect request, as signed and as checked."""
    return json.dumps(connect, sort_keys=True, separators=(",", ":"))


def weight_version(raw: object) -> int:
    """vLLM's weight version is a string (``"default"`` before any update)."""
    try:
        return int(str(raw))
    except ValueError:
        return 0


class VllmEngines:
    """Trainer rank 0's client of every vLLM engine (same surface as ``control.Engines``)."""

    kind = "vllm"

    def __init__(self, urls: Sequence[str], timeout_s: float, token: str | None = None, *,
                 update_timeout_s: float = 600.0, pause_mode: str = "wait") -> None:
        # vLLM's own routes take no shardsync bearer; a fresh connection per call: after a 500
        # vLLM's server drops the kept-alive one (seen: the next call reads a reset)
        self.http = Engines(urls, timeout_s, keepalive=False)
        self.urls, self.secret = self.http.urls, token
        self.update_timeout_s, self.pause_mode = update_timeout_s, pause_mode
        self.requests: list[ConnectRequest] = []
        self.store: dist.Store | None = None
        self.keys: Keys | None = None
        self.seq = 0  # updates and checks on this connection (store keys)

    # -- connect-time --

    def info(self) -> list[InfoResponse]:
        out = []
        for url, raw, ver in zip(self.urls, self.http.call("GET", "/server_info?config_format=json"),
                                 self.http.call("GET", "/weight_info"), strict=True):
            cfg = raw.get("vllm_config")
            if not isinstance(cfg, dict) or cfg.get("weight_transfer_config", {}).get("backend") != "shardsync":
                raise SyncError(f"{url}: not a vLLM engine with the shardsync weight-transfer backend; start it "
                                "with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                "'{\"backend\": \"shardsync\"}' (docs/vllm.md)")
            par, model = cfg["parallel_config"], cfg["model_config"]
            out.append(InfoResponse(spec={}, tp=par["tensor_parallel_size"], pp=par["pipeline_parallel_size"],
                                    dtype=str(model["dtype"]).removeprefix("torch."), kind="vllm",
                                    quantization=model.get("quantization"),
                                    weight_version=weight_version(ver.get("weight_version")), stale=False))
        return out

    def _init(self, join: bool) -> None:
        def body(req: ConnectRequest) -> dict:
            connect = req.model_dump(mode="json")
            mac = auth.mac(self.secret, MAC_KEY, connect_body(connect)) if self.secret else None
            return {"init_info": {"connect": connect, "join": join, "mac": mac}}

        self.http.call("POST", "/init_weight_transfer_engine", [body(r) for r in self.requests],
                       timeout_s=self.update_timeout_s)

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
        """Every worker checks the plans and its own layout; nothing is joined."""
        self.requests = list(requests)
        self._init(join=False)

    def join(self) -> None:
        """Every worker joins the sync group; an update session a gone trainer left open
        (its workers report it) is closed, without a version, before this trainer's first."""
        self._init(join=True)
        timeout = datetime.timedelta(seconds=self.update_timeout_s)
        left_open = [get(self.store, self.keys.rank_joined(i, r), Joined, timeout, self.secret).session_open
                     for i, req in enumerate(self.requests) for r in range(req.engines[i])]
        if any(left_open):
            self.close_session()

    def bind(self, store: dist.Store, keys: Keys) -> None:
        self.store, self.keys, self.seq = store, keys, 0

    # -- per update --

    def _update_info(self, version: int, mode: Mode, **extra) -> dict:
        return {"update_info": {"seq": self.seq, "version": version, "mode": mode.value, **extra}}

    def start(self) -> None:
        self.http.call("POST", f"/pause?mode={self.pause_mode}")
        self.http.call("POST", "/start_weight_update")

    def send(self, info: dict) -> None:
        self.http.call("POST", "/update_weights", [info] * len(self.urls), timeout_s=self.update_timeout_s)

    def results(self, version: int, mode: Mode) -> list[UpdateResult]:
        timeout = datetime.timedelta(seconds=self.update_timeout_s)
        out = []
        for i, req in enumerate(self.requests):
            reports = [get(self.store, self.keys.rank_result(self.seq, i, r), RankReport, timeout, self.secret)
                       for r in range(req.engines[i])]
            out.append(reduce_reports(version, mode.value, reports))
        return out

    def end(self, version: int) -> None:
        """The update succeeded everywhere: vLLM takes the version and generates again."""
        self.http.call("POST", "/finish_weight_update", [{"weight_version": str(version)}] * len(self.urls))
        self.http.call("POST", "/resume")

    def close_session(self) -> None:
        """End vLLM's update session, keeping its version and leaving it paused."""
        self.http.call("POST", "/finish_weight_update", [{"weight_version": None}] * len(self.urls))

    def settle(self, version: int, mode: Mode) -> list[UpdateResult]:
        """Every worker's report; on success vLLM moves to ``version`` and resumes, on any
        failure it stays paused on its previous weights (``SyncError`` says which rank)."""
        try:
            results = self.results(version, mode)
        except Exception as err:
            self.close_session_quietly()
            raise SyncError(f"vLLM update {version}: no report from every worker ({err}); vLLM stays "
                            "paused until a full update succeeds") from None
        bad = next((r for r in results if not r.ok), None)
        if bad is not None:
            self.close_session_quietly()
            raise SyncError(f"{bad.error}; vLLM stays paused until a full update succeeds")
        self.end(version)
        return results

    def close_session_quietly(self) -> None:
        """``close_session``, when a failure is already being reported."""
        try:
            self.close_session()
        except Exception:  # the engine may be gone too; the next connect closes what is left
            pass

    def channel(self) -> VllmChannel:
        return VllmChannel(self)

    # -- occasional --

    def versions(self) -> list[VersionResponse]:
        return [VersionResponse(weight_version=weight_version(r.get("weight_version")), stale=False, connected=True)
                for r in self.http.call("GET", "/weight_info")]

    def pull(self, root: str, version: int) -> list[UpdateResult]:
        """A disk delta: one round whose receive reads the published parts."""
        self.seq += 1
        self.start()
        self.send(self._update_info(version, Mode.DELTA_DISK, root=root, base_version=None))
        return self.settle(version, Mode.DELTA_DISK)

    def checksums(self) -> list[ChecksumResponse]:
        """Each worker's checksums of what it holds (a round that changes no weight)."""
        self.seq += 1
        version = self.versions()[0].weight_version
        self.http.call("POST", "/start_weight_update")
        self.send(self._update_info(version, Mode.BROADCAST, op="checksum"))
        self.close_session()
        timeout = datetime.timedelta(seconds=self.update_timeout_s)
        out = []
        for i, req in enumerate(self.requests):
            parts = [get(self.store, self.keys.rank_checksums(self.seq, i, r), RankSums, timeout, self.secret).keyed()
                     for r in range(req.engines[i])]
            sums = {k: (None if v is None else str(v)) for k, v in combine(parts).items()}
            out.append(ChecksumResponse(weight_version=version, stale=False, checksums=sums))
        return out

    def disconnect(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine")

    def close(self) -> None:
        self.http.close()


class VllmChannel:
    """Begin and finish of one update on every vLLM engine (``control.UpdateChannel``)."""

    def __init__(self, engines: VllmEngines) -> None:
        self.engines = engines
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-update")
        self._sending: Future | None = None
        self._mode: Mode | None = None

    def begin(self, req: BeginRequest) -> None:
        e = self.engines
        e.seq += 1
        e.start()
        info = e._update_info(req.version, Mode(req.mode), fingerprint=req.fingerprint, base_version=req.base_version)
        self._mode = Mode(req.mode)
        self._sending = self._pool.submit(e.send, info)  # returns once every worker received

    def finish(self, version: int) -> list[UpdateResult]:
        try:
            self._sending.result(timeout=self.engines.update_timeout_s + 30)
        except Exception as err:
            self.engines.close_session_quietly()
            raise SyncError(f"vLLM update {version} failed: {err}; vLLM stays paused on its previous "
                            "weights until a full update succeeds") from None
        return self.engines.settle(version, self._mode)
