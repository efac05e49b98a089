"""One SGLang TP rank's receiver, built from the live model on its first call.

SGLang's parameters are shardsync's engine layout (fused ``qkv_proj`` / ``gate_up_proj``,
64-padded vocab, FusedMoE ``w13_weight`` / ``w2_weight`` under the triton backend), so a
receive lands in ``param.data`` in place; when they are not (another MoE backend, another
padding), the rank says why and takes whole tensors through SGLang's own ``load_weights``.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol, cast

import torch

from shardsync.control.hosted import connect_body
from shardsync.control.sglang import ENV_LAYOUT, MAC_KEY, Checked, SglangCall
from shardsync.control.wire import ConnectRequest
from shardsync.dtypes import dtype_name
from shardsync.engines.sglang.adapter import Adapters
from shardsync.engines.sglang.fp8 import Served, served
from shardsync.layout.engine import EngineParallel, variant_choices
from shardsync.lora import Lora
from shardsync.receiver import Receiver, Slice
from shardsync.receiver.hosted import Call, HostedRank, hosted_receiver
from shardsync.receiver.match import live_difference
from shardsync.receiver.receiver import engine_rank
from shardsync.receiver.viewed import loader_refusal
from shardsync.spec import spec_from_config
from shardsync.store import auth
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.store.sealed import put
from shardsync.store.secret import load_secret
from shardsync.vocab import Refused

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

# MoE runner backends whose expert tensors are shardsync's engine layout (gate then up per
# expert, [E/ep, 2I/moe_tp, H] and [E/ep, H, I/moe_tp]); others repack or interleave.
MOE_BACKENDS = ("auto", "triton")


class _SglangModel(Protocol):
    """What an SGLang model class holds besides ``nn.Module``'s (torch's stubs read any module attribute as a
    tensor or module)."""

    config: PretrainedConfig

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> object: ...


def refresh_derived(model: torch.nn.Module) -> int:
    """Recompute what SGLang derives from loaded norms and its own loader refreshes, which an
    in-place write leaves stale: ``GemmaRMSNorm.gemma_weight`` = weight + 1 (Qwen3-Next's
    zero-centred norms; SGLang's fused CUDA norm paths read it).  Returns how many it refreshed."""
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    norms = [m for m in model.modules() if isinstance(m, GemmaRMSNorm)]
    with torch.no_grad():
        for norm in norms:
            norm.refresh_gemma_weight()
    return len(norms)


def amx_packed(model: torch.nn.Module) -> str | None:
    """Why ``model``'s parameters are not the checkpoint's layout on SGLang's CPU build: its
    linears repack their weights for AMX after a load (``amx_utils``) and mark the module."""
    from sglang.srt.utils.common import use_intel_amx_backend

    packed = [n for n, m in model.named_modules() if use_intel_amx_backend(m)]
    return None if not packed else (f"SGLang packed {packed[0]} ({len(packed)} modules) for its CPU AMX kernels: an "
                                    "in-place write would not be that layout")


def moe_backend() -> str:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    backend = get_moe_runner_backend()
    return str(getattr(backend, "value", backend))


def parallel() -> dict[str, int]:
    """This process's place in SGLang's parallel layout."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return {k: int(getattr(par, k, default)) for k, default in
            (("tp_rank", 0), ("tp_size", 1), ("pp_rank", 0), ("pp_size", 1), ("moe_ep_size", 1))}


def sglang_loader(model: torch.nn.Module):
    """SGLang's own ``load_weights``, fed whole checkpoint tensors (every rank keeps its shard)."""

    def load(slices: Iterator[Slice]) -> None:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for s in slices:  # whole layouts: every slice is a whole tensor
                yield s.name, s.tensor
        with torch.no_grad():
            cast(_SglangModel, model).load_weights(tensors())

    return load


class SglangHost:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        p = parallel()
        self.tp_rank, self.tp_size, self.ep = p["tp_rank"], p["tp_size"], p["moe_ep_size"]
        self.pp_rank, self.pp = p["pp_rank"], p["pp_size"]
        self.index = self.pp_rank * self.tp_size + self.tp_rank  # SGLang's world rank rule, less its offset
        self.secret = load_secret().value
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self._receivers: dict[bool, Receiver] = {}
        self.served = Served()  # what SGLang's parameters hold (FP8 or the model dtype)
        self.problem: str | None = None
        self.rank: HostedRank | None = None
        self.variants: frozenset[str] = frozenset()
        self.nonce: str | None = None  # given in the last accepted check, spent by the join that carries it
        try:
            self._build()
        except Exception as e:  # refuse at connect, with the reason
            self.problem = f"{type(e).__name__}: {e}"
            log.warning("shardsync: this SGLang rank cannot receive updates: %s", self.problem)

    def _build(self) -> None:
        packed = amx_packed(self.model)
        if packed is not None:
            raise ValueError(packed)
        cfg = cast(_SglangModel, self.model).config
        self.spec = spec_from_config(cfg.to_dict(), name=str(getattr(cfg, "_name_or_path", "") or "sglang"))
        self.adapters = Adapters(self.spec, self.tp_rank, self.tp_size, self.pp, self.dtype, self.secret)
        self.served = served(self.model)
        if self.pp > 1 and os.environ.get("SGLANG_PP_LAYER_PARTITION"):
            raise ValueError("SGLANG_PP_LAYER_PARTITION is set; shardsync plans SGLang's even layer split only")
        self.variants, reason = self._variants()
        if reason is None and self.spec.num_experts and moe_backend() not in MOE_BACKENDS:
            reason = (f"SGLang's MoE runner backend {moe_backend()!r} holds experts in its own layout; shardsync's "
                      f"is that of {MOE_BACKENDS} (--moe-runner-backend triton)")
        if os.environ.get(ENV_LAYOUT) == "whole":
            reason = f"{ENV_LAYOUT}=whole in SGLang's environment"
        refusal = loader_refusal(self.served.views)  # an FP8 loader would cast bf16 into the e4m3 weights
        if reason is not None and refusal is not None:
            raise ValueError(f"{refusal}, and cannot here: {reason}")
        self.rank = HostedRank(self.spec, self.tp_rank, self.tp_size, self._receiver, secret=self.secret,
                               mac_key=MAC_KEY, engine="SGLang", layout_reason=reason,
                               dtype_name=str(self.dtype).removeprefix("torch."), ep=self.ep, pp_rank=self.pp_rank,
                               pp=self.pp, variants=self.variants)
        log.info("shardsync: SGLang pp%d tp%d/%d receives %s%s", self.pp_rank, self.tp_rank, self.tp_size,
                 f"whole tensors only ({reason})" if reason else
                 f"into its parameters in place (layout variants {sorted(self.variants)})",
                 self.served)

    def _variants(self) -> tuple[frozenset[str], str | None]:
        """The engine layout variants this rank's parameters are (SGLang decides some, such as
        its shared-expert fusion, from the GPU it runs on), or why they are none of them."""
        par = EngineParallel(tp=self.tp_size, ep=self.ep, pp=self.pp)
        first: str | None = None
        for variants in variant_choices(self.spec, par):
            _, rank = engine_rank(self.spec, self.tp_rank, self.tp_size, dtype_name=dtype_name(self.dtype),
                                  ep=self.ep, pp_rank=self.pp_rank, pp=self.pp, variants=variants)
            reason = live_difference(rank, self.model, "SGLang", targets=self.served.targets(rank, self.spec),
                                     skip=self.served.skip)
            if reason is None:
                return variants, None
            first = first or reason
        return frozenset(), first

    def _receiver(self, whole: bool, lora: Lora | None = None) -> Receiver:
        """Shards in place (SGLang's parameters are shardsync's layout, or the connect is
        refused before this), whole tensors through SGLang's own ``load_weights``; an adapter
        into the directory SGLang loads it from (``engines.sglang.adapter``)."""
        rx = self.adapters.receiver(whole, lora)  # an adapter sync's (None: the model's)
        if rx is not None:
            return rx
        if whole not in self._receivers:
            self._receivers[whole] = hosted_receiver(
                self.spec, self.tp_rank, self.tp_size, whole=whole, in_place=True, params=self._live,
                load=sglang_loader(self.model), dtype=self.dtype, device=self.device, secret=self.secret, ep=self.ep,
                pp_rank=self.pp_rank, pp=self.pp, variants=self.variants, views=self.served.views)
        return self._receivers[whole]

    def _live(self) -> dict[str, torch.Tensor]:
        return {n: p.data for n, p in self.model.named_parameters()}

    # -- calls --

    def run(self, call: SglangCall) -> None:
        if not call.verify(self.secret):
            log.warning("shardsync: tp%d: %s call not signed with this engine's secret; refused", self.tp_rank, call.op)
            return
        if time.time() > call.expires:
            log.warning("shardsync: tp%d: %s call expired %.0f s ago (replayed?); refused", self.tp_rank, call.op,
                        time.time() - call.expires)
            return
        if call.op == "check":
            self._check(call)
        elif call.op == "join":
            if self.rank is None:
                log.warning("shardsync: tp%d cannot join: %s", self.tp_rank, self.problem)
                return
            if not self._spend_nonce(call):
                log.warning("shardsync: tp%d: join without this rank's fresh nonce (replayed, or no accepted check "
                            "before it); refused", self.tp_rank)
                return
            if call.connect is None:
                log.warning("shardsync: tp%d: a join without its connect; refused", self.tp_rank)
                return
            self.rank.join(call.connect, self._connect_mac(call.connect))
        elif call.op == "leave":
            if self.rank is not None and self.rank.keys is not None and self.rank.keys.name == call.name:
                self.rank.leave()
        else:
            self._update(call)

    def _spend_nonce(self, call: SglangCall) -> bool:
        """Whether the join carries the nonce this rank gave its last accepted check (then spent:
        a replayed join finds none; a stale one leaves it for the trainer's own join)."""
        given = (call.nonces or {}).get(str(self.index))
        if self.nonce is None or given is None or not hmac.compare_digest(given, self.nonce):
            return False
        self.nonce = None
        return True

    def _connect_mac(self, connect: dict) -> str:
        """The call's signature already covers its connect: sign the connect for the check."""
        return auth.mac(self.secret, MAC_KEY, connect_body(connect))

    def _check(self, call: SglangCall) -> None:
        """Check the connect and answer in the trainer's store (the call was signed)."""
        req = ConnectRequest.model_validate(call.connect)
        assert call.connect is not None  # validated just above
        rdv = Rendezvous(**req.rendezvous.model_dump())
        answer = Checked()
        try:
            if self.rank is None:
                raise ValueError(f"shardsync: {self.problem}")
            self.rank.check(call.connect, self._connect_mac(call.connect))
            self.nonce = secrets.token_hex(16)
            answer = Checked(nonce=self.nonce)
        except Refused as e:
            answer = Checked(error=str(e)[:4000], reason=e.reason,
                             variants=None if e.variants is None else e.variants.get(req.engine_index))
        except Exception as e:
            answer = Checked(error=(str(e) or type(e).__name__)[:4000])
        store = open_store(rdv, is_master=False)
        put(store, Keys(call.name).rank_checked(call.attempt, req.engine_index, self.index), answer, self.secret)

    def follow_params(self) -> bool:
        """Point the in-place receiver at the parameters' current storage when SGLang rebound
        any since the last update (a session that repacks weights may); True when it had to."""
        rx = self._receivers.get(False)
        if rx is None or not rx.destination.rebind({n: p.data for n, p in self.model.named_parameters()}):
            return False
        log.info("shardsync: tp%d: SGLang rebound parameters since the last update; receiving into the new ones",
                 self.tp_rank)
        return True

    def _update(self, call: SglangCall) -> None:
        rank = self.rank
        if rank is None or rank.keys is None or rank.keys.name != call.name:
            log.warning("shardsync: tp%d: %s for sync %s, not this rank's connection; ignored", self.tp_rank,
                        call.op, call.name)
            return
        self.follow_params()
        rank.update(Call.model_validate(call.update))
        post = getattr(self.model, "post_load_weights", None)
        if call.op == "update" and not rank.stale and callable(post):
            post()  # SGLang runs it only when no load ran in the session; a custom loader counts as one
        if call.op == "update" and not rank.stale:
            refresh_derived(self.model)
