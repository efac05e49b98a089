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

import time
from collections.abc import Sequence

from shardsync.control.adapters import vllm_served
from shardsync.control.client import Engines, SyncError
from shardsync.control.hosted import LAYOUT_MISMATCH, HostedEngines, call_body, connect_body, weight_version
from shardsync.control.wire import ConnectRequest, InfoResponse, VersionResponse
from shardsync.lora import Lora
from shardsync.store import auth
from shardsync.vocab import Reason, Refused

VARIANTS = frozenset({"vllm"})  # vLLM's engine layout variants (layout.engine.ENGINE_VARIANTS): its names
MAC_KEY = "shardsync/vllm/connect"  # what the worker checks the connect's signature under
UPDATE_MAC_KEY = "shardsync/vllm/update"  # and an update call's
EXPIRY_GRACE_S = 300.0  # an update call expires this long after its HTTP timeout
ENV_LAYOUT = "SHARDSYNC_VLLM_LAYOUT"  # "whole" in vLLM's environment: always receive whole tensors
ENV_LORA_DIR = "SHARDSYNC_VLLM_LORA_DIR"  # in vLLM's environment: the adapter directory shardsync syncs


class VllmEngines(HostedEngines):
    """Trainer rank 0's client of every vLLM engine (same surface as ``control.Engines``)."""

    kind = "vllm"
    name = "vLLM"
    # /pause?mode=: wait lets running requests end on the old weights; both clear vLLM's KV and
    # prefix caches (clear_cache defaults to true)
    PAUSE = {"finish": "wait", "abort": "abort"}
    REFUSED = {"span": "vLLM's pause mode 'keep' resumes running requests on KV caches built on the old weights"}

    def __init__(self, urls: Sequence[str], timeout_s: float, token: str, *,
                 update_timeout_s: float = 600.0, crossing: str | None = None, lora: Lora | None = None) -> None:
        # vLLM's own routes take no shardsync bearer; a fresh connection per call: after a 500
        # vLLM's server drops the kept-alive one (seen: the next call reads a reset)
        self.http = Engines(urls, timeout_s, None, keepalive=False)  # vLLM's routes: no bearer
        super().__init__(self.http.urls, update_timeout_s, token)
        self.pause_mode = self.pause_mode_for(crossing)
        self.lora = lora

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
                                    variants=sorted(VARIANTS),
                                    quantization=model.get("quantization"), lora=vllm_served(url, cfg, self.lora),
                                    weight_version=weight_version(ver.get("weight_version")), stale=False))
        return out

    def _init(self, join: bool) -> None:
        def body(req: ConnectRequest) -> dict:
            connect = req.model_dump(mode="json")
            mac = auth.mac(self.secret, MAC_KEY, connect_body(connect))
            return {"init_info": {"connect": connect, "join": join, "mac": mac}}

        self.http.call("POST", "/init_weight_transfer_engine", [body(r) for r in self.requests],
                       timeout_s=self.update_timeout_s)

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
        """Every worker checks the plans and its own layout; nothing is joined.  vLLM answers a
        worker's refusal as text only: the layout refusal is typed here, at that edge."""
        self.requests = list(requests)
        try:
            self._init(join=False)
        except SyncError as e:
            if LAYOUT_MISMATCH in str(e):
                raise Refused(str(e), Reason.LAYOUT_MISMATCH) from None
            raise

    def join(self) -> None:
        """Every worker joins the sync group; an update session a gone trainer left open
        (its workers report it) is closed, without a version, before this trainer's first."""
        self._init(join=True)
        if self.joined():
            self.close_session()

    # -- per update --

    def start(self) -> None:
        self.http.call("POST", f"/pause?mode={self.pause_mode}")
        self.http.call("POST", "/start_weight_update")

    def send(self, info: dict) -> None:
        """``info`` (a ``receiver.hosted.Call``) rides vLLM's update info whole, as one field,
        signed with its connection's name and an expiry (vLLM's route itself is not guarded)."""
        expires = time.time() + self.update_timeout_s + EXPIRY_GRACE_S
        name = self.requests[0].rendezvous.name
        mac = auth.mac(self.secret, UPDATE_MAC_KEY, call_body(name, info, expires))
        self.http.call("POST", "/update_weights", [{"update_info": {"call": info, "mac": mac, "expires": expires}}]
                       * len(self.urls), timeout_s=self.update_timeout_s)

    def end(self, version: int) -> None:
        self.http.call("POST", "/finish_weight_update", [{"weight_version": str(version)}] * len(self.urls))
        self.http.call("POST", "/resume")

    def close_session(self) -> None:
        self.http.call("POST", "/finish_weight_update", [{"weight_version": None}] * len(self.urls))

    def checksum_round(self, info: dict) -> None:
        self.http.call("POST", "/start_weight_update")
        self.send(info)
        self.close_session()

    # -- occasional --

    def versions(self) -> list[VersionResponse]:
        return [VersionResponse(weight_version=weight_version(r.get("weight_version")), stale=False, connected=True)
                for r in self.http.call("GET", "/weight_info")]

    def disconnect(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine")

    def close(self) -> None:
        self.http.close()
