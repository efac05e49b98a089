"""shardsync: plan once which bytes each trainer rank owes each engine rank, then move only those."""

from shardsync.layout import (
    EngineParallel,
    MegatronParallel,
    engine_layout,
    full_layout,
    megatron_layout,
)
from shardsync.plan import Plan, PlanError, build_plan, make_buckets
from shardsync.spec import PRESETS, ModelSpec, load_spec
from shardsync.topology import Topology

__all__ = [
    "PRESETS",
    "EngineParallel",
    "MegatronParallel",
    "ModelSpec",
    "Plan",
    "PlanError",
    "Topology",
    "build_plan",
    "engine_layout",
    "full_layout",
    "load_spec",
    "make_buckets",
    "megatron_layout",
]
