"""The ``shardsync`` weight-transfer backend: one ``Receiver`` per vLLM worker.

vLLM drives it: ``init_weight_transfer_engine`` twice per connect (``join=False`` checks
the trainer's plans and this worker's layout and joins nothing; ``join=True`` joins the
sync group), then per update ``start_weight_update`` -> ``update_weights`` (the receive:
every worker takes only the bytes of its TP rank) -> ``finish_weight_update``.

Through vLLM's loader the receive lands in staging first and vLLM's weights change only
once every byte of the version arrived, so a failed or cut receive leaves vLLM on its
previous version, whole.  Each worker writes its ``RankReport`` (and, when asked, its
checksums) into the sync group's store, signed; vLLM's HTTP answers carry no results.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shardsync.control import auth
from shardsync.control.report import rank_report
from shardsync.control.vllm import ENV_LAYOUT, LAYOUT_MISMATCH, MAC_KEY, UPDATE_FAILED, connect_body
from shardsync.control.wire import ConnectRequest, Joined, Keys, RankReport, RankSums, put
from shardsync.engines.vllm import params
from shardsync.mode import Mode
from shardsync.paths import UpdateArgs
from shardsync.plan.local import region
from shardsync.receiver import Loader, Params, Receiver, Slice, check_connect
from shardsync.runtime.stats import Stats
from shardsync.spec import spec_from_config

log = logging.getLogger(__name__)


ERROR_BYTES = 1024  # what a worker's error message may take when TP workers agree on it


@dataclass
class ShardsyncInitInfo(WeightTransferInitInfo):
    connect: dict  # a ``ConnectRequest`` (the wire schema)
    join: bool = False  # False: check only; True: join the sync group
    mac: str | None = None  # the trainer's HMAC of ``connect`` with the shared secret


@dataclass
class ShardsyncUpdateInfo(WeightTransferUpdateInfo):
    seq: int  # this update's number on the connection (store keys)
    version: int
    mode: str
    fingerprint: str = ""
    base_version: int | None = None
    root: str | None = None  # delta-disk: the published directory
    op: str = "update"  # or "checksum": report this rank's piece checksums, change nothing


def reprocess_tied(model: torch.nn.Module) -> None:
    """Run the load-time processing again on every module that shares a parameter with
    another.  vLLM's layerwise reload processes a tied parameter in one owner only (its
    documented limitation): on CPU a tied ``lm_head`` keeps the oneDNN copy of the old
    embedding it packed at start, and generation runs on the previous version's logits."""
    owners: dict[int, list[torch.nn.Module]] = {}
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(mod)
    for mods in owners.values():
        for mod in mods if len(mods) > 1 else ():
            method = getattr(mod, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(mod)


def loader_for(model: torch.nn.Module, model_config, dtype: torch.dtype):
    """vLLM's own loader under its layerwise reload, fed one checkpoint tensor at a time: this
    rank's boxes in a zero tensor of the full HF shape (vLLM keeps only its TP rank's part), or
    the staged tensor itself when this rank holds it whole (TP 1, whole-tensor layouts)."""

    def load(slices: Iterator[Slice]) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        boxes: dict[str, list[Slice]] = {}
        for s in slices:
            boxes.setdefault(s.name, []).append(s)
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, parts in boxes.items():
                if len(parts) == 1 and tuple(parts[0].tensor.shape) == parts[0].full_shape:
                    yield name, parts[0].tensor  # the staged tensor is the whole one: no copy
                    continue
                full = torch.zeros(parts[0].full_shape, dtype=dtype, device=parts[0].tensor.device)
                for s in parts:
                    full[region(s.offsets, tuple(s.tensor.shape))] = s.tensor
                yield name, full

        initialize_layerwise_reload(model)
        try:  # one load_weights call over the whole stream, as vLLM's own reload does
            model.load_weights(tensors())
        finally:
            finalize_layerwise_reload(model, model_config)
        reprocess_tied(model)

    return load


class ShardsyncEngine(WeightTransferEngine[ShardsyncInitInfo, ShardsyncUpdateInfo]):
    init_info_cls = ShardsyncInitInfo
    update_info_cls = ShardsyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        self.secret = auth.load_token()
        self.dtype = self.model_config.dtype
        self.receiver: Receiver | None = None  # the connected one
        self._receivers: dict[bool, Receiver] = {}  # by whole
        self.problem: str | None = None  # why this worker cannot receive at all
        self.layout_reason: str | None = None
        self.keys: Keys | None = None
        self.fingerprints: dict[str, str] = {}
        self.engine_index = 0
        self.version: int | None = None  # last version applied through shardsync
        self.stale = False  # staging no longer holds ``version`` (a delta cannot apply)
        self.session_open = False  # mirrors vLLM's "weight update active" flag of this worker
        try:
            self._build()
        except Exception as e:  # never break vLLM's start: refuse at connect instead
            self.problem = f"{type(e).__name__}: {e}"
            log.warning("shardsync: this vLLM worker cannot receive updates: %s", self.problem)

    def _build(self) -> None:
        if self.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("vLLM runs pipeline parallel; shardsync receives into PP 1 engines only")
        if self.model_config.quantization is not None:
            raise ValueError(f"vLLM runs {self.model_config.quantization} quantization; shardsync "
                             "syncs unquantized weights")
        self.spec = spec_from_config(self.model_config.hf_config.to_dict(), name=str(self.model_config.model))
        probe = Receiver(self.spec, self.tp_rank, self.tp_size, Params({}), dtype=self.dtype, device=self.device)
        self.kind, self.layout_reason = params.choose(probe.rank_layout, self.model, self.dtype)
        if os.environ.get(ENV_LAYOUT) == "whole":
            self.kind, self.layout_reason = "loader", f"{ENV_LAYOUT}=whole in vLLM's environment"
        log.info("shardsync: vLLM tp%d/%d receives into %s%s", self.tp_rank, self.tp_size, self.kind,
                 f" (whole tensors only: {self.layout_reason})" if self.layout_reason else "")

    def _receiver(self, whole: bool) -> Receiver:
        """This worker's receiver for engine-layout shards or for whole tensors (built once)."""
        if whole not in self._receivers:
            probe = Receiver(self.spec, self.tp_rank, self.tp_size, Params({}), dtype=self.dtype,
                             device=self.device, whole=whole)
            if self.kind == "params" and not whole:
                dest = Params({n: p.data for n, p in self.model.named_parameters()})
            else:
                dest = Loader(probe.rank_layout, probe.layout.logical,
                              loader_for(self.model, self.model_config, self.dtype), dtype=self.dtype,
                              device=self.device)
            self._receivers[whole] = Receiver(self.spec, self.tp_rank, self.tp_size, dest, dtype=self.dtype,
                                              device=self.device, secret=self.secret, whole=whole)
        return self._receivers[whole]

    # -- connect --

    def _agree(self, fn, *args) -> None:
        """Run ``fn`` here, then tell every TP worker whether any failed; only the last TP rank
        raises.  vLLM's executor reads worker answers in rank order and stops at the first
        failure: an exception on an earlier rank leaves the later ranks' answers queued, and
        every later call of vLLM's then gets the answer of the call before it (seen)."""
        try:
            fn(*args)
            error = ""
        except Exception as e:
            error = str(e) or type(e).__name__
        if self.tp_size == 1:
            if error:
                raise RuntimeError(error)
            return
        from vllm.distributed import get_tp_group

        mine = torch.zeros(ERROR_BYTES, dtype=torch.uint8)
        raw = error.encode()[:ERROR_BYTES]
        mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        every = [torch.zeros_like(mine) for _ in range(self.tp_size)]
        torch.distributed.all_gather(every, mine, group=get_tp_group().cpu_group)
        errors = [bytes(t.tolist()).rstrip(b"\0").decode(errors="replace") for t in every]
        first = next((e for e in errors if e), None)
        if first and self.tp_rank == self.tp_size - 1:
            raise RuntimeError(first)

    def init_transfer_engine(self, init_info: ShardsyncInitInfo) -> None:
        self._agree(self._init, init_info)

    def _init(self, init_info: ShardsyncInitInfo) -> None:
        if self.problem:
            raise ValueError(f"shardsync: {self.problem}")
        if self.secret is not None:
            if not init_info.mac or not auth.verify_mac(self.secret, MAC_KEY, connect_body(init_info.connect),
                                                        init_info.mac):
                raise PermissionError("shardsync: connect not signed with this engine's token; refused")
        req = ConnectRequest.model_validate(init_info.connect)
        if self.secret is None and not auth.is_loopback(req.rendezvous.host):
            raise PermissionError(f"shardsync: rendezvous at {req.rendezvous.host} is not loopback and this "
                                  f"engine has no token (${auth.ENV_TOKEN}); refused")
        whole = bool(req.whole) and req.engine_index < len(req.whole) and req.whole[req.engine_index]
        if self.layout_reason and not whole:
            raise ValueError(f"shardsync: {LAYOUT_MISMATCH}: {self.layout_reason}")
        rx = self._receiver(whole)
        fingerprints = check_connect(req, self.spec, self.tp_size, str(self.dtype).removeprefix("torch."))
        if not init_info.join:
            return
        if self.receiver is not None and self.receiver is not rx:
            self.receiver.leave()
        rx.join(req)
        self.receiver, self.fingerprints = rx, fingerprints
        self.keys, self.engine_index = Keys(req.rendezvous.name), req.engine_index
        self.stale = True  # the first update of a connection is a full one
        # a session a gone trainer left open: the new one closes it before its first update
        put(rx.group.store, self.keys.rank_joined(self.engine_index, self.tp_rank),
            Joined(session_open=self.session_open), self.secret)

    # -- update --

    # The update lifecycle never raises into vLLM: vLLM keeps a per-worker "update active"
    # flag that an exception resets on that worker alone, and an exception on one worker
    # desynchronizes the answers of every later call (``_agree``).  Failures travel as
    # ``RankReport(ok=False)`` through the sync group's store instead.

    def start_weight_update(self) -> None:
        self.session_open = True

    def receive_weights(self, update: ShardsyncUpdateInfo) -> None:
        t0 = time.perf_counter()
        rx = self.receiver
        if rx is None or not rx.connected or self.keys is None:
            log.warning("shardsync: tp%d: update %d without a connection; ignored (the trainer times out "
                        "waiting for this rank's report)", self.tp_rank, update.version)
            return
        store = rx.group.store
        if update.op == "checksum":
            put(store, self.keys.rank_checksums(update.seq, self.engine_index, self.tp_rank),
                RankSums.of(rx.checksums()), self.secret)
            return
        key = self.keys.rank_result(update.seq, self.engine_index, self.tp_rank)
        try:
            report = rank_report(self._receive(rx, update), t0, rx.destination.name)
        except Exception as e:
            log.warning("shardsync: tp%d: update %d (%s) failed: %s", self.tp_rank, update.version, update.mode, e)
            report = RankReport(ok=False, error=f"{UPDATE_FAILED}: version {update.version} on tp{self.tp_rank}: "
                                                f"{e}; vLLM keeps its previous weights; reconnect and send a full update")
        try:
            put(store, key, report, self.secret)
        except Exception as e:  # the trainer is gone: nobody to tell
            log.warning("shardsync: tp%d: cannot report update %d: %s", self.tp_rank, update.version, e)

    def _receive(self, rx: Receiver, update: ShardsyncUpdateInfo) -> Stats:
        mode = Mode(update.mode)
        if mode.is_delta and (self.stale or update.base_version != self.version):
            raise ValueError(f"delta against version {update.base_version}, but this worker "
                             f"{'is stale' if self.stale else f'holds {self.version}'}: send a full update")
        if mode is not Mode.DELTA_DISK and self.fingerprints.get(mode.plan.value) != update.fingerprint:
            raise ValueError(f"{mode} plan fingerprint differs from the connected one")
        self.stale = True
        if mode is Mode.DELTA_DISK:
            stats = rx.pull(update.root, update.version, update.base_version)
        else:
            stats = rx.receive(mode, UpdateArgs(version=update.version, base_version=update.base_version))
        self.version, self.stale = update.version, False
        return stats

    def finish_weight_update(self) -> None:
        self.session_open = False

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.leave()
        self.keys = None

