"""``shardsync bench``: measure which transport and engine-wave policy is fastest here.

Pure parts (partitioning, policies, workloads, per-rank programs, metrics, provenance)
are separate from the part that touches process groups (``run``).
"""

from shardsync.bench.policy import POLICIES, WavePlan, plan_waves
from shardsync.bench.sweep import BenchConfig, Point, expand
from shardsync.bench.topology import BenchLayout, partition

__all__ = ["POLICIES", "BenchConfig", "BenchLayout", "Point", "WavePlan", "expand", "partition",
           "plan_waves"]
