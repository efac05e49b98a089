"""What trainer rank 0 decides at connect from its engines' own facts (never from its own
config): which client speaks to them, the decision every trainer rank shares, the sync's
rendezvous, and the connection's topology."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Protocol

from pydantic import ValidationError

from shardsync.control.client import EngineClient, Engines, SyncError
from shardsync.control.sglang import SglangEngines
from shardsync.control.vllm import VllmEngines
from shardsync.control.wire import Decision, EngineFacts, InfoResponse
from shardsync.layout import EngineParallel, Fsdp2Parallel, MegatronParallel
from shardsync.lora import Lora
from shardsync.quant.support import refusal
from shardsync.spec import ModelSpec
from shardsync.store.rendezvous import Rendezvous
from shardsync.topology import STAGED_KINDS, Topology
from shardsync.views import Host, views_of
from shardsync.vocab import Channel, Crossing


class HostedClient(Protocol):
    """How a client of engines that host the receiver behind their own endpoints is made."""

    def __call__(self, urls: Sequence[str], timeout_s: float, token: str, *,
                 update_timeout_s: float = 600.0, crossing: str | None = None,
                 lora: Lora | None = None) -> EngineClient: ...


# control channels whose engines host the receiver behind their own endpoints (answers
# through the sync group's store)
HOSTED: dict[Channel, HostedClient] = {Channel.VLLM: VllmEngines, Channel.SGLANG: SglangEngines}


def engine_client(channel: Channel, urls: Sequence[str], http_timeout_s: float, secret: str, *,
                  update_timeout_s: float, crossing: Crossing | None, lora: Lora | None = None) -> EngineClient:
    """The client of every engine of one trainer, for the control channel they speak (``lora``:
    the adapter the trainer syncs, for engines whose facts cannot name the adapter they serve)."""
    hosted = HOSTED.get(channel)
    if hosted is not None:
        return hosted(urls, http_timeout_s, secret, update_timeout_s=update_timeout_s, crossing=crossing, lora=lora)
    return Engines(urls, http_timeout_s, secret, store_channel=channel is Channel.STORE)


def decide(infos: Sequence[InfoResponse], *, port: int) -> Decision:
    """One plan for engines that agree on dtype, kind, pipeline stages and quantization (their
    TP and EP may differ); a ``SyncError`` names what they disagree on."""
    dtypes = {i.dtype for i in infos}
    if len(dtypes) != 1:
        raise SyncError(f"engines run different dtypes {sorted(dtypes)}")
    staged = {i.kind for i in infos} <= set(STAGED_KINDS)  # their pipeline stages are planned per rank
    try:
        facts = [EngineFacts(kind=i.kind, pp=i.pp, quantization=i.quantization, lora=i.lora) for i in infos]
        if staged:
            facts = [f.model_copy(update={"pp": 1}) for f in facts]
    except ValidationError as e:
        raise SyncError(f"an engine's facts are out of bounds: {e}") from None
    one = facts[0]
    if any(f != one for f in facts):
        raise SyncError(f"engines differ in (kind, pp, quantization, adapter): "
                        f"{sorted({f.model_dump_json() for f in facts})}")
    refused = refusal(one.quantization)
    if refused is not None:
        raise SyncError(refused)
    return Decision(tps=[i.tp for i in infos], eps=[i.ep for i in infos],
                    pps=[i.pp for i in infos] if staged else [], dtype=dtypes.pop(), port=port,
                    variants=[i.variants for i in infos] if any(i.variants for i in infos) else [],
                    name=f"shardsync-{uuid.uuid4().hex[:16]}", facts=one)


def rendezvous_of(decision: Decision, trainer_ranks: int, *, host: str, backend: str, timeout_s: float) -> Rendezvous:
    """The sync group's rendezvous: every trainer rank and every engine rank (TP x PP)."""
    pps = decision.pps or [1] * len(decision.tps)
    engine_ranks = sum(tp * pp for tp, pp in zip(decision.tps, pps, strict=True))
    return Rendezvous(host, decision.port, trainer_ranks + engine_ranks, decision.name, backend, timeout_s)


def topology_of(decision: Decision, spec: ModelSpec, trainer: MegatronParallel | Fsdp2Parallel, *, relay: bool,
                whole: bool, lora: Lora | None = None) -> Topology:
    """The connection's topology from the engines' facts (``whole``: engines whose own loaders
    shard whole tensors; ``lora``: the adapter this trainer syncs, which they must serve)."""
    facts = decision.facts
    refused = views_of(facts.quantization, facts.lora).mismatch(lora)  # the views the engines serve
    if refused is not None:
        raise SyncError(f"{refused}: start the engines with the trainer's LoRA rank, alpha and targets "
                        "(--lora-rank/--lora-alpha/--lora-targets), or set SyncConfig(lora=...) to what they serve")
    n = len(decision.tps)
    eps, pps = decision.eps or [1] * n, decision.pps or [1] * n
    variants = [[]] * n if whole or not decision.variants else decision.variants
    dtype = decision.dtype
    return Topology(spec.replace(dtype=dtype), trainer,
                    tuple(EngineParallel(tp=t, ep=ep, pp=pp, dtype=dtype, whole=whole, variants=frozenset(v))
                          for t, ep, pp, v in zip(decision.tps, eps, pps, variants, strict=True)),
                    views=views_of(facts.quantization, lora), relay=relay, host=Host(facts.kind, facts.pp))
