"""The trainer's client of SGLang engines, through SGLang's own endpoints only.

SGLang (started with ``--custom-weight-loader shardsync.engines.sglang.load``) calls that
function in every TP rank's scheduler with its live model whenever
``/update_weights_from_tensor`` names it as ``load_format``; the function's answer is
ignored, so every rank writes its report into the sync group's store (``receiver.hosted``).
One shardsync call rides in each request as a signed JSON message (``SglangCall``) packed
into the one tensor SGLang hands the loader.  Per update, O(1) calls per engine whatever
the bucket count: ``/pause_generation`` -> ``/begin_weight_update`` ->
``/update_weights_from_tensor`` (runs while the trainer sends) -> ``/end_weight_update``
-> on success ``/update_weight_version`` and ``/continue_generation``; a failed update ends
the session and SGLang stays paused until a full update succeeds.  docs/sglang.md.
"""

from __future__ import annotations

import base64
import datetime
import os
import pickle
import time
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field

from shardsync.control.adapters import sglang_crossing, sglang_reload, sglang_served
from shardsync.control.client import Engines, SyncError
from shardsync.control.hosted import HostedEngines, canonical, weight_version
from shardsync.control.wire import ConnectRequest, InfoResponse, Msg, Variants, VersionResponse
from shardsync.lora import Lora
from shardsync.store import auth
from shardsync.store.sealed import get
from shardsync.vocab import Reason, Refused

ENTRY = "shardsync.engines.sglang.load"  # --custom-weight-loader and load_format
MAC_KEY = "shardsync/sglang/call"  # what a rank checks a call's signature under
TENSOR_NAME = "shardsync"  # the one named tensor a call travels as
MAX_CALL_BYTES = 1 << 20  # a connect names a spec and four fingerprints: far below
PAUSE_MODES = ("abort", "retract", "in_place")
ENV_API_KEY = "SHARDSYNC_SGLANG_API_KEY"  # the trainer's bearer for SGLang's --api-key / --admin-api-key
ENV_LAYOUT = "SHARDSYNC_SGLANG_LAYOUT"  # "whole" in SGLang's environment: always receive whole tensors
ENV_LORA_DIR = "SHARDSYNC_SGLANG_LORA_DIR"  # in SGLang's environment: the adapter directory shardsync syncs
# a call expires this long after its HTTP timeout (clocks of trainer and engine hosts may differ)
EXPIRY_GRACE_S = 300.0


class SglangCall(Msg):
    """One shardsync call as an SGLang rank reads it (signed over everything but ``mac``)."""

    op: Literal["check", "join", "update", "checksum", "leave"]
    name: str = Field(min_length=1, max_length=128)  # the sync (the rendezvous name)
    attempt: int = Field(default=0, ge=0, le=1 << 20)  # check: which connect attempt answers
    connect: dict | None = Field(default=None, max_length=32)  # check / join: a ConnectRequest
    update: dict | None = Field(default=None, max_length=16)  # update / checksum: a ``receiver.hosted.Call``
    # join: each rank's one-time nonce from its check answer (rank index -> nonce): a captured
    # join replayed later finds its nonce spent (and cannot reset the connection's call numbers)
    nonces: dict[str, str] | None = Field(default=None, max_length=4096)
    expires: float = Field(default=0.0, ge=0)  # unix seconds; a rank refuses a call after it (0: always)
    mac: str | None = Field(default=None, max_length=128)

    def body(self) -> str:
        """The canonical JSON a signature covers."""
        return canonical(self.model_dump(exclude={"mac"}, mode="json"))

    def signed(self, secret: str) -> SglangCall:
        return self.model_copy(update={"mac": auth.mac(secret, MAC_KEY, self.body())})

    def verify(self, secret: str) -> bool:
        return self.mac is not None and auth.verify_mac(secret, MAC_KEY, self.body(), self.mac)


class Checked(Msg):
    """One rank's answer to a connect check: None, or what is wrong (and its kind, if a caller acts on it)."""

    error: str | None = Field(default=None, max_length=4096)
    reason: Reason | None = None
    variants: Variants | None = None  # a layout refusal: the variants this rank's parameters are
    nonce: str | None = Field(default=None, max_length=64)  # accepted: what this rank's join must carry


class _Bytes:
    """Pickles as ``torch.ByteTensor([...])``: the only tensor constructor SGLang's safe
    unpickler admits that takes plain data (a storage pickle would need ``torch.load``)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self):
        return torch.ByteTensor, (list(self.data),)


def payload(call: SglangCall) -> str:
    """``serialized_named_tensors[i]`` for every TP rank: base64 of ``[("shardsync", bytes)]``."""
    raw = call.model_dump_json().encode()
    if len(raw) > MAX_CALL_BYTES:
        raise ValueError(f"shardsync call of {len(raw)} bytes exceeds {MAX_CALL_BYTES}")
    return base64.b64encode(pickle.dumps([(TENSOR_NAME, _Bytes(raw))], protocol=4)).decode()


def read_call(named_tensors) -> SglangCall:
    """The call in what SGLang hands the loader; a ``ValueError`` for anything else."""
    items = list(named_tensors)
    if len(items) != 1 or items[0][0] != TENSOR_NAME:
        raise ValueError(f"expected one tensor named {TENSOR_NAME!r}, got {[n for n, _ in items][:4]}")
    t = items[0][1]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_CALL_BYTES:
        raise ValueError("the shardsync call is not a 1-D uint8 tensor within the size bound")
    return SglangCall.model_validate_json(bytes(t.cpu().tolist()))


class SglangEngines(HostedEngines):
    """Trainer rank 0's client of every SGLang engine (same surface as ``control.Engines``)."""

    kind = "sglang"
    name = "SGLang"

    # /pause_generation modes: retract re-queues running requests (their KV freed, re-prefilled
    # on the new weights); in_place would keep KV caches built on the old weights
    PAUSE = {"abort": "abort", "span": "retract"}
    REFUSED = {"finish": f"SGLang's /pause_generation cannot wait for running requests (its modes: {PAUSE_MODES})"}
    DEFAULT_CROSSING = "abort"

    def __init__(self, urls: Sequence[str], timeout_s: float, token: str, *,
                 update_timeout_s: float = 600.0, crossing: str | None = None,
                 api_key: str | None = None, lora: Lora | None = None) -> None:
        pause_mode = self.pause_mode_for(crossing)
        sglang_crossing(lora, pause_mode)
        self.http = Engines(urls, timeout_s, api_key or os.environ.get(ENV_API_KEY) or None, keepalive=False)
        super().__init__(self.http.urls, update_timeout_s, token)
        self.pause_mode, self.timeout_s = pause_mode, timeout_s
        self.attempt = 0
        self.nonces: dict[int, dict[str, str]] = {}  # engine -> its ranks' nonces from the last check
        self.lora = lora  # the adapter the trainer syncs
        self.adapters: list[tuple[str, str] | None] = []  # each engine's served adapter (name, directory)

    def _all(self, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> list[dict]:
        """POST ``path`` to every engine; an answer ``success: false`` is a ``SyncError``."""
        answers = self.http.call("POST", path, [body or {}] * len(self.urls), timeout_s=timeout_s)
        for url, a in zip(self.urls, answers, strict=True):
            if isinstance(a, dict) and a.get("success") is False:
                raise SyncError(f"{url}{path}: {a.get('message', a)}")
        return answers

    def _call(self, call: SglangCall, *, timeout_s: float | None = None) -> None:
        """Hand every rank of every engine one shardsync call (each engine gets its own)."""
        bodies = []
        limit = timeout_s or self.update_timeout_s
        for i in range(len(self.urls)):
            mine: dict = {"expires": time.time() + limit + EXPIRY_GRACE_S}
            if call.connect is not None:  # each engine its own connect request
                mine["connect"] = self.requests[i].model_dump(mode="json")
            if call.op == "join":  # and its ranks' nonces
                mine["nonces"] = self.nonces.get(i, {})
            body = payload(call.model_copy(update=mine).signed(self.secret))
            bodies.append({"serialized_named_tensors": [body] * self.requests[i].engines[i], "load_format": ENTRY,
                           "flush_cache": True, "selector": "target"})
        answers = self.http.call("POST", "/update_weights_from_tensor", bodies,
                                 timeout_s=timeout_s or self.update_timeout_s)
        for url, a in zip(self.urls, answers, strict=True):
            if isinstance(a, dict) and a.get("success") is False:
                raise SyncError(f"{url}/update_weights_from_tensor: {a.get('message', a)}")

    # -- connect-time --

    def info(self) -> list[InfoResponse]:
        out = []
        self.adapters = []
        for url, raw, ver in zip(self.urls, self.http.call("GET", "/server_info"),
                                 self.http.call("GET", "/model_info"), strict=True):
            loaders = raw.get("custom_weight_loader") or []
            if ENTRY not in loaders:
                raise SyncError(f"{url}: SGLang without shardsync's weight loader; start it with "
                                f"--custom-weight-loader {ENTRY} (docs/sglang.md)")
            dp = int(raw.get("dp_size") or 1)
            if dp != 1:
                raise SyncError(f"{url}: SGLang runs --dp-size {dp}; give each data-parallel replica its own "
                                "server (one engine URL per replica)")
            lora, entry = sglang_served(url, raw, self.lora)
            self.adapters.append(entry)
            out.append(InfoResponse(spec={}, tp=int(raw.get("tp_size") or 1), pp=int(raw.get("pp_size") or 1),
                                    ep=int(raw.get("ep_size") or 1), dtype=server_dtype(url, raw.get("dtype")),
                                    kind="sglang", quantization=raw.get("quantization"), lora=lora,
                                    weight_version=weight_version(ver.get("weight_version")), stale=False))
        return out

    def _begin(self) -> None:
        """Open an update session on every engine; one a gone trainer left open is closed first."""
        try:
            self._all("/begin_weight_update", {"selector": "target"})
        except SyncError as e:
            if "already open" not in str(e):
                raise
            self.close_session_quietly()
            self._all("/begin_weight_update", {"selector": "target"})

    def _session(self, fn, *args) -> None:
        """``fn`` inside an update session on every engine (SGLang refuses loads outside one)."""
        self._begin()
        try:
            fn(*args)
        finally:
            self._all("/end_weight_update")

    def connect(self, requests: Sequence[ConnectRequest]) -> None:
        """Every rank checks the plans and its own layout (answers in the store); nothing is joined."""
        self.requests = list(requests)
        self.attempt += 1
        name = self.requests[0].rendezvous.name
        self._session(self._call, SglangCall(op="check", name=name, attempt=self.attempt, connect={}))
        timeout = datetime.timedelta(seconds=self.timeout_s)
        refused: Refused | None = None
        variants: dict[int, list[str]] = {}  # every engine's, so that one new plan fits them all
        self.nonces = {}
        for i, r in self.ranks():
            try:
                store, keys = self._bound()
                answer = get(store, keys.rank_checked(self.attempt, i, r), Checked, timeout, self.secret)
            except Exception:
                raise SyncError(f"{self.urls[i]}: tp{r} did not answer the connect check in {timeout.seconds}s "
                                f"(SGLang started with --custom-weight-loader {ENTRY} and the same "
                                "$SHARDSYNC_TOKEN? its log says why)") from None
            if answer.reason is not None:
                refused = refused or Refused(f"{self.urls[i]}: {answer.error}", answer.reason)
                if answer.variants is not None:
                    variants[i] = answer.variants
            elif answer.error:
                raise SyncError(f"{self.urls[i]}: {answer.error}")
            elif answer.nonce is not None:
                self.nonces.setdefault(i, {})[str(r)] = answer.nonce
        if refused is not None:
            refused.variants = variants or None
            raise refused

    def join(self) -> None:
        """Every rank joins the sync group (the call returns once the group is whole)."""
        name = self.requests[0].rendezvous.name
        self._session(self._call, SglangCall(op="join", name=name, connect={}))
        self.joined()

    # -- per update --

    def start(self) -> None:
        self._all("/pause_generation", {"mode": self.pause_mode})
        self._begin()

    def send(self, info: dict) -> None:
        name = self.requests[0].rendezvous.name
        self._call(SglangCall(op="checksum" if info.get("op") == "checksum" else "update", name=name, update=info))

    def end(self, version: int) -> None:
        self._all("/end_weight_update")
        sglang_reload(self.http, self.adapters)
        self._all("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
        self._all("/continue_generation", {})

    def close_session(self) -> None:
        self._all("/end_weight_update")

    def close_session_quietly(self) -> None:
        """End every engine's session, whichever has one (a failure is already being reported)."""
        for i in range(len(self.urls)):
            try:
                self.http.call_one(i, "POST", "/end_weight_update", {})
            except Exception:  # no session there, or the engine is gone
                pass

    def checksum_round(self, info: dict) -> None:
        self._session(self.send, info)

    # -- occasional --

    def versions(self) -> list[VersionResponse]:
        return [VersionResponse(weight_version=weight_version(v.get("weight_version")), stale=False, connected=True)
                for v in self.http.call("GET", "/model_info")]

    def disconnect(self) -> None:
        name = self.requests[0].rendezvous.name if self.requests else "-"
        self._session(self._call, SglangCall(op="leave", name=name))

    def close(self) -> None:
        self.http.close()


DTYPES = ("bfloat16", "float16", "float32")


def server_dtype(url: str, raw: object) -> str:
    """The weight dtype ``/server_info`` names; SGLang's default ``auto`` (resolved inside the
    scheduler from the checkpoint) is not reported, so the trainer cannot plan from it."""
    dtype = str(raw).removeprefix("torch.")
    if dtype not in DTYPES:
        raise SyncError(f"{url}: SGLang reports dtype {dtype!r}; start it with --dtype one of {list(DTYPES)} so the "
                        "trainer can plan the wire dtype (docs/sglang.md)")
    return dtype


