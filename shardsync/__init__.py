"""shardsync: plan once which bytes each trainer rank owes each engine rank, then move only those.

Trainer side: ``WeightSync`` with a ``SyncConfig``.  Engine side: a ``Receiver`` per engine
rank writing into a ``Params`` or ``Loader`` destination.  Metadata only: ``Topology``,
layouts and plans.  Names resolve lazily, so importing the receiver pulls in no HTTP client.
"""

from __future__ import annotations

import importlib

_NAMES = {
    # trainer side
    "WeightSync": "shardsync.sync", "SyncError": "shardsync.control.client",
    "SyncConfig": "shardsync.config", "TransportConfig": "shardsync.config", "DeltaConfig": "shardsync.config",
    "ColocatedConfig": "shardsync.config", "ControlConfig": "shardsync.config",
    "UpdateRecord": "shardsync.runtime.record", "UpdateResult": "shardsync.runtime.ledger",
    # engine side
    "Receiver": "shardsync.receiver", "Params": "shardsync.receiver", "Loader": "shardsync.receiver",
    "Slice": "shardsync.receiver",
    # both
    "Mode": "shardsync.mode", "Stats": "shardsync.runtime.stats",
    # metadata: models, layouts, plans
    "PRESETS": "shardsync.presets", "ModelSpec": "shardsync.spec", "load_spec": "shardsync.presets",
    "EngineParallel": "shardsync.layout", "MegatronParallel": "shardsync.layout", "Fsdp2Parallel": "shardsync.layout",
    "fsdp2_parallel": "shardsync.fsdp2", "local_shards": "shardsync.fsdp2",
    "engine_layout": "shardsync.layout", "full_layout": "shardsync.layout", "megatron_layout": "shardsync.layout",
    "Plan": "shardsync.plan", "PlanError": "shardsync.plan", "build_plan": "shardsync.plan",
    "make_buckets": "shardsync.plan", "Topology": "shardsync.topology",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str):
    if name not in _NAMES:
        raise AttributeError(f"module 'shardsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(_NAMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
