"""What a sync will cost, per path, from metadata alone (``shardsync plan``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from shardsync.layout import MegatronParallel
from shardsync.plan.bucket import make_buckets
from shardsync.plan.preconditions import check_p2p
from shardsync.topology import Topology


@dataclass(frozen=True)
class PathSummary:
    path: str
    total_bytes: int
    busiest_link_bytes: int
    busiest_link: str
    per_receiver_bytes: int
    buckets: int
    copies: int


def _p2p(topo: Topology, budget: int) -> PathSummary:
    plan = topo.p2p_plan
    (s, d), b = plan.busiest_link()
    return PathSummary(
        "p2p", plan.total_bytes, b,
        f"{plan.src.ranks[s].label} -> {plan.dst.ranks[d].label}",
        max(plan.bytes_per_dst().values()), len(make_buckets(plan, budget)), len(plan.copies),
    )


def _broadcast(topo: Topology, budget: int) -> PathSummary:
    plan = topo.broadcast_plan
    (s, d), b = plan.busiest_link()
    # One collective per bucket of a source: count the buckets towards one receiver.
    copies = plan.copies_to(0)
    buckets = make_buckets(plan, budget, copies)
    return PathSummary(
        "broadcast", plan.total_bytes, b,
        f"{plan.src.ranks[s].label} -> every engine rank",
        max(plan.bytes_per_dst().values()), len(buckets), len(copies),
    )


def summarize(topo: Topology, bucket_bytes: int, progress: Callable[[str], None] = lambda stage: None) -> dict:
    """``progress(stage)`` after each stage (the largest presets take seconds)."""
    verdicts = check_p2p(topo)
    progress("layouts built, p2p preconditions checked")
    paths = [_broadcast(topo, bucket_bytes)]
    progress("broadcast plan and buckets")
    if all(v.ok for v in verdicts):
        paths.insert(0, _p2p(topo, bucket_bytes))
        progress("p2p plan and buckets")
    return {
        "model": topo.spec.name,
        "trainer": {"kind": topo.trainer.kind, **topo.trainer.describe(),
                    **({"ep": topo.trainer.ep, "etp": topo.trainer.expert_tp}
                       if topo.spec.is_moe and isinstance(topo.trainer, MegatronParallel) else {})},
        "engines": [e.tp for e in topo.engines],
        **({"engine_ep": [e.ep for e in topo.engines]} if topo.spec.is_moe else {}),
        "bucket_bytes": bucket_bytes,
        "paths": [asdict(p) for p in paths],
        "p2p_preconditions": [asdict(v) for v in verdicts],
        "p2p_ok": all(v.ok for v in verdicts),
    }
