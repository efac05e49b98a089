"""A connect request, both ways: the trainer's payload from its topology, and the
topology and plan fingerprints an engine rebuilds from it (refused with a typed error)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shardsync.control.session import Conflict, Invalid
from shardsync.control.wire import PROTOCOL_VERSION, ConnectRequest
from shardsync.layout import EngineParallel, Fsdp2Parallel, MegatronParallel
from shardsync.mode import FULL, Mode
from shardsync.spec import ModelSpec
from shardsync.store.rendezvous import Rendezvous
from shardsync.topology import Topology
from shardsync.views import NO_VIEWS, Views
from shardsync.vocab import Channel, DeltaTransport, Ipc


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    return spec.to_dict()


def spec_from_dict(d: dict[str, Any]) -> ModelSpec:
    return ModelSpec.from_dict(d)


def connect_request(topo: Topology, index: int, fingerprints: dict[str, str], rdv: Rendezvous, *,
                    bucket_bytes: int, credits: int, ipc: Ipc | None, control: Channel,
                    verify: bool = False, delta: DeltaTransport | None = None) -> ConnectRequest:
    """What trainer rank 0 sends engine ``index`` of ``topo``."""
    t = topo.trainer
    if isinstance(t, Fsdp2Parallel):  # kind "fsdp2"
        trainer = {"kind": "fsdp2", "shard": t.shard, "replicate": t.replicate, "dtype": t.dtype}
    else:
        trainer = {"tp": t.tp, "pp": t.pp, "dp": t.dp, "pp_layers": list(t.pp_layers) if t.pp_layers else None,
                   "make_vocab_size_divisible_by": t.make_vocab_size_divisible_by,
                   "norm_names": t.norm_names, "dtype": t.dtype, "ep": t.ep, "etp": t.etp,
                   "expert_names": t.expert_names}
    return ConnectRequest.model_validate({
        "spec": spec_to_dict(topo.spec),
        "trainer": trainer,
        "engines": [e.tp for e in topo.engines], "engine_index": index, "fingerprints": fingerprints,
        "whole": [e.whole for e in topo.engines] if any(e.whole for e in topo.engines) else [],
        "engine_ep": [e.ep for e in topo.engines] if any(e.ep > 1 for e in topo.engines) else [],
        "engine_pp": [e.pp for e in topo.engines] if any(e.pp > 1 for e in topo.engines) else [],
        "engine_variants": [sorted(e.variants) for e in topo.engines] if any(e.variants for e in topo.engines) else [],
        "bucket_bytes": bucket_bytes, "credits": credits, "relay": topo.relay, "ipc": ipc,
        "control": control, "verify": verify, "delta": delta, "rendezvous": dataclasses.asdict(rdv),
        "lora": topo.lora,
    })


def topology_from_connect(req: ConnectRequest, dtype: str, views: Views = NO_VIEWS) -> Topology:
    """The topology a connect request describes, with this engine's wire dtype and the views it
    serves (an FP8 engine's plans carry its weights quantized: ``quant.wire``); the caller checked
    that the request's adapter is the one ``views`` hold (``req.lora``)."""
    spec = spec_from_dict(req.spec).replace(dtype=dtype)
    t = req.trainer.model_dump()
    kind, shard, replicate = t.pop("kind"), t.pop("shard"), t.pop("replicate")
    if t.get("pp_layers") is not None:
        t["pp_layers"] = tuple(t["pp_layers"])
    trainer = (Fsdp2Parallel(shard=shard, replicate=replicate, dtype=t["dtype"]) if kind == "fsdp2"
               else MegatronParallel(**t))
    whole = req.whole or [False] * len(req.engines)
    if len(whole) != len(req.engines):
        raise ValueError(f"whole names {len(whole)} engines, engines {len(req.engines)}")
    eps = req.engine_ep or [1] * len(req.engines)
    if len(eps) != len(req.engines):
        raise ValueError(f"engine_ep names {len(eps)} engines, engines {len(req.engines)}")
    pps = req.engine_pp or [1] * len(req.engines)
    if len(pps) != len(req.engines):
        raise ValueError(f"engine_pp names {len(pps)} engines, engines {len(req.engines)}")
    variants = req.engine_variants or [[]] * len(req.engines)
    if len(variants) != len(req.engines):
        raise ValueError(f"engine_variants names {len(variants)} engines, engines {len(req.engines)}")
    engines = tuple(EngineParallel(tp=tp, ep=ep, pp=pp, dtype=dtype, whole=w, variants=frozenset(v))
                    for tp, ep, pp, w, v in zip(req.engines, eps, pps, whole, variants, strict=True))
    return Topology(spec, trainer, engines, views=views, relay=req.relay)


PUSH_NEEDS_STAGING = ("ipc='push' writes an engine's staging copy, and this engine receives into {where}: "
                      "start it with whole-shard staging (EngineConfig(staging_bytes=-1), --staging-bytes shard) "
                      "or connect with ipc='map'")


def check_connect(req: ConnectRequest, spec: ModelSpec, tp: int, dtype: str, ep: int = 1,
                  pp: int = 1, *, staging: str | None = None,
                  variants: frozenset[str] = frozenset(), views: Views = NO_VIEWS) -> dict[str, str]:
    """This engine's fingerprints of the plans ``req`` names; a ``SessionError`` saying what
    differs when trainer and engine disagree (nothing is joined or changed).  ``staging``:
    where this engine receives, unless it stages whole shards (what a push needs); ``variants``:
    this engine's layout variants, which the plan must have been made for; ``views``: what it
    serves (its FP8 format; its adapter, which an adapter sync must name)."""
    if req.protocol != PROTOCOL_VERSION:
        raise Conflict(f"protocol {req.protocol} != engine protocol {PROTOCOL_VERSION}")
    if req.ipc is Ipc.PUSH and staging is not None:
        raise Conflict(PUSH_NEEDS_STAGING.format(where=staging))
    try:  # the architecture first (cheap): nothing is planned for a model this engine is not
        theirs = spec_from_dict(req.spec)
    except (TypeError, ValueError) as e:
        raise Invalid(f"cannot read the trainer's model spec: {e}") from None
    if theirs.replace(name=spec.name, dtype=dtype) != spec.replace(dtype=dtype):
        raise Conflict(f"trainer model {theirs.name} differs from this engine's {spec.name}: sync "
                       "needs identical architectures")
    try:
        theirs_lora = req.lora
    except (TypeError, ValueError) as e:
        raise Invalid(f"cannot read the trainer's adapter: {e}") from None
    refused = views.mismatch(theirs_lora)
    if refused is not None:
        raise Conflict(f"{refused}: start the engine with the trainer's LoRA rank, alpha and targets (or connect "
                       "a full-model sync)")
    try:
        topo = topology_from_connect(req, dtype, views)
    except (TypeError, ValueError) as e:
        raise Invalid(f"cannot build the sync topology: {e}") from None
    declared = req.engines[req.engine_index] if req.engine_index < len(req.engines) else None
    if declared != tp:
        raise Conflict(f"engine {req.engine_index} declared with TP {declared if declared else '?'}, "
                       f"this engine runs TP {tp}")
    declared_ep = topo.engines[req.engine_index].ep
    if declared_ep != ep:
        raise Conflict(f"engine {req.engine_index} declared with expert parallel {declared_ep}, this engine runs "
                       f"EP {ep}")
    declared_pp = topo.engines[req.engine_index].pp
    if declared_pp != pp:
        raise Conflict(f"engine {req.engine_index} declared with pipeline parallel {declared_pp}, this engine runs "
                       f"PP {pp}")
    declared_variants = topo.engines[req.engine_index].variants
    if declared_variants != variants and not topo.engines[req.engine_index].whole:
        raise Conflict(f"engine {req.engine_index} planned with layout variants {sorted(declared_variants)}, "
                       f"this engine holds {sorted(variants)}")
    if not req.fingerprints:
        raise Invalid("a connect names at least one plan fingerprint (broadcast)")
    mine = {}
    for mode, fp in req.fingerprints.items():
        if mode not in {m.value for m in FULL}:
            raise Invalid(f"unknown mode {mode!r} in fingerprints")
        try:
            mine[mode] = topo.fingerprint(Mode(mode).value)
        except ValueError as e:
            raise Conflict(f"{mode} plan cannot be built here: {e}") from None
        if mine[mode] != fp:
            raise Conflict(f"{mode} plan fingerprint mismatch: trainer {fp}, engine {mine[mode]}; "
                           f"trainer and engine disagree on the layouts{views.hint()}")
    return mine
