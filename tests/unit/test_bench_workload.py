"""Workloads move the bytes they claim: synthetic sizes, and exactly a real plan's bytes."""

from __future__ import annotations

from collections import Counter

import pytest

from shardsync.bench.sweep import BenchConfig, expand
from shardsync.bench.topology import partition
from shardsync.bench.workload import from_plan, plan_topology, synthetic


def test_synthetic_gives_every_engine_rank_the_same_bytes_either_way() -> None:
    lay = partition(6, trainer_ranks=2, group_sizes=(3, 1))
    p2p = synthetic(lay, "p2p", nbytes=1000, count=4)
    bc = synthetic(lay, "broadcast", nbytes=1000, count=4)
    assert [len(m) for m in p2p.messages] == [12, 4] and [len(m) for m in bc.messages] == [4, 4]
    assert [p2p.delivered_bytes(g) for g in (0, 1)] == [bc.delivered_bytes(g) for g in (0, 1)] == [12000, 4000]
    assert {m.src for m in p2p.messages[1]} == {1}, "group 1 is fed by trainer rank 1"
    with pytest.raises(ValueError, match="transport"):
        synthetic(lay, "rdma", nbytes=1, count=1)


def test_plan_workload_moves_exactly_the_plans_link_bytes() -> None:
    lay = partition(6, trainer_ranks=2, group_size=2)
    wl = from_plan(lay, "p2p", model="tiny-qwen3", trainer_tp=2, engine_tp=2, bucket_bytes=256 << 10)
    plan = plan_topology("tiny-qwen3", 2, 2).p2p_plan
    for g, ranks in enumerate(lay.groups):
        got = Counter()
        for m in wl.messages[g]:
            got[(m.src, ranks.index(m.dst))] += m.nbytes
            assert m.nbytes <= 256 << 10
        assert dict(got) == plan.link_bytes
    assert wl.delivered_bytes(0) == plan.total_bytes


def test_plan_broadcast_moves_the_full_model_to_each_engine_rank() -> None:
    lay = partition(5, group_size=2)
    wl = from_plan(lay, "broadcast", model="tiny-qwen3", trainer_tp=2, engine_tp=None, bucket_bytes=1 << 20)
    per_receiver = plan_topology("tiny-qwen3", 2, 2).broadcast_plan.bytes_per_dst()[0]
    assert wl.delivered_bytes(1) == 2 * per_receiver
    assert {m.src for m in wl.messages[1]} == {0} and all(m.dst is None for m in wl.messages[1])


def test_plan_folds_trainer_ranks_and_checks_engine_tp() -> None:
    lay = partition(5, group_size=2)
    wl = from_plan(lay, "p2p", model="tiny-qwen3", trainer_tp=2, engine_tp=2, bucket_bytes=1 << 20)
    assert {m.src for ms in wl.messages for m in ms} == {0}
    with pytest.raises(ValueError, match="engine group 0 has 2 rank"):
        from_plan(lay, "p2p", model="tiny-qwen3", trainer_tp=2, engine_tp=4, bucket_bytes=1 << 20)


def test_sweep_is_the_cartesian_product_and_window_multiplies_only_windowed() -> None:
    cfg = BenchConfig(transports=("broadcast", "p2p"), bucket_mb=(0.25, 1), credits=(1, 2),
                      policies=("all_at_once", "windowed", "serialized"), windows=(1, 2),
                      stride_us=(0, 500), reuse=(True, False), inflight_mb=(None, 0.5))
    points = expand(cfg)
    assert len(points) == 2 * 2 * 2 * 2 * (1 + 2 + 1) * 2 * 2
    assert len(set(points)) == len(points)
    assert {p.bucket_bytes for p in points} == {1 << 18, 1 << 20}
    with pytest.raises(ValueError, match="--policy"):
        BenchConfig(policies=("fastest",))
    with pytest.raises(ValueError, match="--bucket-mb"):
        BenchConfig(bucket_mb=(0,))
