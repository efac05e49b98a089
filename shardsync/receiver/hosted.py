"""One engine rank's ``Receiver`` inside an engine that relays no answer (vLLM's workers,
SGLang's schedulers): connect and update calls arrive through the engine's own plug-in
point, signed; every outcome goes back to the trainer through the sync group's store.

``update`` never raises: an exception kills SGLang's scheduler and desynchronizes vLLM's
workers.  A failed receive is reported (``RankReport(ok=False)``) and leaves this rank
stale until a full update succeeds.  The rank decides what it accepts with the same
``UpdateSession`` the reference engine uses (fingerprints, delta bases, staleness, the call
sequence), so both refuse the same updates in the same words.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Literal, get_args

import torch
from pydantic import Field

from shardsync.control.hosted import LAYOUT_MISMATCH, UPDATE_FAILED, connect_body
from shardsync.control.metrics import process_metrics
from shardsync.control.session import Conflict, Invalid, UpdateSession
from shardsync.control.wire import (
    MAX_VERSION,
    BeginRequest,
    ConnectRequest,
    Joined,
    Msg,
    RankSums,
    Version,
)
from shardsync.delta.disk import read_manifest
from shardsync.dtypes import dtype_name
from shardsync.lora import Lora
from shardsync.mode import Mode
from shardsync.paths import UpdateArgs
from shardsync.receiver.connect import check_connect
from shardsync.receiver.destination import Destination, Loader, Params, Slice
from shardsync.receiver.receiver import Receiver, engine_rank
from shardsync.receiver.viewed import EngineRank, loader_refusal, wrap
from shardsync.runtime.ledger import RankReport, UpdateResult
from shardsync.spec import ModelSpec
from shardsync.store import auth
from shardsync.store.keys import Keys
from shardsync.store.sealed import put
from shardsync.views import NO_VIEWS, Views
from shardsync.vocab import Reason, Refused

log = logging.getLogger(__name__)


_ModeName = Literal["p2p", "broadcast", "delta-p2p", "delta-broadcast", "delta-disk"]  # a ``Mode``'s value
assert set(get_args(_ModeName)) == {m.value for m in Mode}, "_ModeName lists every Mode"


class Call(Msg):
    """One update (or checksum round) as the trainer's client names it."""

    seq: int = Field(ge=1, le=MAX_VERSION)  # this call's number on the connection (store keys)
    version: Version
    mode: _ModeName
    fingerprint: str = Field("", max_length=64)
    base_version: Version | None = None
    root: str | None = Field(None, max_length=4096)  # delta-disk: the published directory
    op: Literal["update", "checksum"] = "update"  # checksum: report this rank's checksums, change nothing


def hosted_receiver(spec: ModelSpec, tp_rank: int, tp_size: int, *, whole: bool, in_place: bool,
                    params: Callable[[], Mapping[str, torch.Tensor]], load: Callable[[Iterator[Slice]], None],
                    dtype: torch.dtype, device: torch.device | str, secret: str, ep: int = 1,
                    pp_rank: int = 0, pp: int = 1, variants: frozenset[str] = frozenset(),
                    views: Views = NO_VIEWS) -> Receiver:
    """One rank's receiver inside a hosting engine (vLLM, SGLang): shards land in place in the
    engine's parameters (``params()``) when they are shardsync's engine layout (``in_place``)
    and the trainer plans shards; whole tensors, or parameters the engine repacks, go through
    the engine's own loader (``load``), which shards them itself.  ``views``: what the parameters
    serve (an FP8 format: shards in place only, ``receiver.viewed``)."""
    layout, rank = engine_rank(spec, tp_rank, tp_size, dtype_name=dtype_name(dtype), whole=whole, ep=ep,
                               pp_rank=pp_rank, pp=pp, variants=variants, views=views)
    dest: Destination
    if in_place and not whole:
        dest = wrap(views, Params(params()), EngineRank(spec, rank, dtype, device))
    else:
        refused = loader_refusal(views)
        if refused is not None:
            raise ValueError(refused)
        dest = Loader(rank, layout.logical, load, dtype=dtype, device=device)
    return Receiver(spec, tp_rank, tp_size, dest, dtype=dtype, device=device, secret=secret, whole=whole, ep=ep,
                    pp_rank=pp_rank, pp=pp, variants=variants, views=views)


class HostedRank:
    """The connection state one engine rank keeps between the engine's calls.

    ``receiver_for(whole, lora)`` builds (once) this rank's receiver for engine-layout shards
    (False) or whole tensors (True), of the model or of the adapter ``lora`` the trainer syncs
    (it raises, saying why, for an adapter the engine does not serve); ``layout_reason`` says
    why shards cannot land here
    (None when they can); ``variants``: the engine layout variants its parameters are;
    ``engine`` names the engine in every message a user reads.
    """

    def __init__(self, spec: ModelSpec, tp_rank: int, tp_size: int,
                 receiver_for: Callable[[bool, Lora | None], Receiver], *, secret: str, mac_key: str, engine: str,
                 layout_reason: str | None = None, dtype_name: str, ep: int = 1, pp_rank: int = 0, pp: int = 1,
                 variants: frozenset[str] = frozenset()) -> None:
        self.spec, self.tp_rank, self.tp_size, self.ep, self.pp = spec, tp_rank, tp_size, ep, pp
        self.variants = variants
        self.index = pp_rank * tp_size + tp_rank  # this rank among the engine's (its store keys)
        self._receiver_for, self.secret, self.mac_key, self.engine = receiver_for, secret, mac_key, engine
        self.layout_reason, self.dtype_name = layout_reason, dtype_name
        self.receiver: Receiver | None = None  # the connected one
        self.keys: Keys | None = None
        self.engine_index = 0
        self.joined_names: set[str] = set()  # every sync this rank joined (a join is never replayed)
        # the version applied through shardsync, staleness, the connection's plans, its calls
        # one rank per engine counts its updates into the host's /metrics (control/metrics.py)
        self.session = UpdateSession(versions_grow=False, metrics=process_metrics() if self.index == 0 else None)

    @property
    def stale(self) -> bool:
        """The weights may hold neither the session's version nor the one before."""
        return self.session.stale

    # -- connect --

    def check(self, connect: dict, mac: str | None) -> tuple[ConnectRequest, Receiver, dict[str, str]]:
        """The trainer's signed connect checked against this rank; raises saying what differs."""
        if not mac or not auth.verify_mac(self.secret, self.mac_key, connect_body(connect), mac):
            raise PermissionError("shardsync: connect not signed with this engine's secret; refused")
        req = ConnectRequest.model_validate(connect)
        whole = bool(req.whole) and req.engine_index < len(req.whole) and req.whole[req.engine_index]
        if self.layout_reason and not whole:
            raise Refused(f"shardsync: {self.engine}'s {LAYOUT_MISMATCH}: {self.layout_reason}", Reason.LAYOUT_MISMATCH)
        planned = req.engine_variants[req.engine_index] if req.engine_index < len(req.engine_variants) else []
        if set(planned) != self.variants and not whole:  # the trainer can plan again for this engine's variants
            raise Refused(f"shardsync: {self.engine}'s {LAYOUT_MISMATCH}: planned with layout variants "
                          f"{sorted(planned)}, its parameters are {sorted(self.variants)}", Reason.LAYOUT_MISMATCH,
                          {req.engine_index: sorted(self.variants)})
        rx = self._receiver_for(whole, req.lora)
        return req, rx, check_connect(req, self.spec, self.tp_size, self.dtype_name, ep=self.ep, pp=self.pp,
                                      staging=rx.unpushable, variants=frozenset() if whole else self.variants,
                                      views=rx.views)

    def join(self, connect: dict, mac: str | None, *, session_open: bool = False) -> None:
        """Check, then join the sync group (bounded); tells the trainer whether an update
        session a gone trainer left open is still open here."""
        req, rx, fingerprints = self.check(connect, mac)
        if req.rendezvous.name in self.joined_names:  # names are fresh per connect: this one is replayed
            raise PermissionError(f"shardsync: sync {req.rendezvous.name} was joined on this rank before: a "
                                  "replayed join; refused")
        self.joined_names.add(req.rendezvous.name)
        if self.receiver is not None and self.receiver is not rx:
            self.receiver.leave()
        rx.join(req)
        assert rx.group is not None, "a receiver that joined holds its group"
        self.receiver = rx
        self.session.joined(req.model_copy(update={"fingerprints": fingerprints}))
        self.session.fail("a new connection: its first update is a full one")
        self.keys, self.engine_index = Keys(req.rendezvous.name), req.engine_index
        put(rx.group.store, self.keys.rank_joined(self.engine_index, self.index), Joined(session_open=session_open),
            self.secret)

    # -- update --

    def update(self, call: Call) -> None:
        """One call of the trainer's, reported through the store; never raises."""
        t0 = time.perf_counter()
        rx = self.receiver
        if rx is None or not rx.connected or self.keys is None:
            log.warning("shardsync: tp%d: update %d without a connection; ignored (the trainer times out "
                        "waiting for this rank's report)", self.tp_rank, call.version)
            return
        try:
            self.session.take_call(call.seq)
        except Conflict as e:
            log.warning("shardsync: tp%d: %s", self.tp_rank, e)
            return
        assert rx.group is not None, "a connected receiver holds its group"
        store = rx.group.store
        if call.op == "checksum":
            try:
                put(store, self.keys.rank_checksums(call.seq, self.engine_index, self.index),
                    RankSums.of(rx.checksums()), self.secret)
            except Exception as e:  # the trainer times out waiting for these sums
                log.warning("shardsync: tp%d: checksums failed: %s", self.tp_rank, e)
            return
        try:
            report = self._receive(rx, call, t0)
        except Exception as e:
            log.warning("shardsync: tp%d: %s %d (%s) failed: %s", self.tp_rank, call.op, call.version, call.mode, e)
            report = RankReport(ok=False, error=f"{UPDATE_FAILED}: version {call.version} on tp{self.tp_rank}: {e}; "
                                                "reconnect and send a full update")
        try:
            put(store, self.keys.rank_result(call.seq, self.engine_index, self.index), report, self.secret)
        except Exception as e:  # the trainer is gone: nobody to tell
            log.warning("shardsync: tp%d: cannot report update %d: %s", self.tp_rank, call.version, e)

    def _receive(self, rx: Receiver, call: Call, t0: float) -> RankReport:
        """The session accepts the call (or raises, weights untouched), the receiver runs it,
        the session settles on its outcome (this rank's ledger: its metrics)."""
        mode = Mode(call.mode)
        if mode is Mode.DELTA_DISK:  # the published manifest names the base, as the reference engine reads it
            if call.root is None:
                raise Invalid("a disk delta names its published directory (root)")
            base = read_manifest(call.root, call.version)["base_version"]
            self.session.begin_pull(call.version, base)
        else:
            base = call.base_version
            self.session.begin(BeginRequest(version=call.version, mode=mode, fingerprint=call.fingerprint,
                                            base_version=base))
        try:
            if mode is Mode.DELTA_DISK:
                stats = rx.pull(call.root, call.version, base)
            else:
                stats = rx.receive(mode, UpdateArgs(version=call.version, base_version=base))
        except Exception as e:
            self.session.settle(UpdateResult(version=call.version, mode=mode, ok=False,
                                             error=f"{type(e).__name__}: {e}"))
            raise
        report = RankReport.of(stats, t0, rx.destination.name)
        self.session.settle(UpdateResult.of(call.version, mode, [report]))
        return report

    def leave(self) -> None:
        if self.receiver is not None:
            self.receiver.leave()
        self.keys = None
