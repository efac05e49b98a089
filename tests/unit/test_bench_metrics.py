"""Percentiles, skew, overlap and per-iteration metrics from hand-made traces."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardsync.bench.metrics import (
    aggregate,
    iteration_metrics,
    max_overlap,
    percentile,
    skew,
    summary,
    union_length,
)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_summary_and_skew() -> None:
    vals = [float(v) for v in range(1, 101)]
    s = summary(vals)
    assert s == {"p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01), "max": 100.0}
    assert skew([3.0, 1.0, 2.5]) == 2.0
    assert skew([]) == 0.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_overlap_counts_half_open_intervals() -> None:
    assert max_overlap([(0, 1, 1), (1, 2, 1)]) == 1  # touching is not overlapping
    assert max_overlap([(0, 3, 5), (1, 2, 7), (1.5, 4, 1)]) == 13
    assert max_overlap([(0, 0, 9)]) == 0
    assert union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def _rank(t0: float, rows: list, phases: dict | None = None) -> dict:
    return {"t0": t0, "transfers": rows, "phases": phases or {"transfer": 0.1}}


def test_iteration_metrics_from_a_serialized_trace() -> None:
    # sender 0 feeds group 0 (rank 1) then group 1 (rank 2); clocks are shared
    ranks = {
        0: _rank(10.0, [[0, "send", 100, 10.1, 10.3, False], [1, "send", 100, 10.5, 10.9, False]]),
        1: _rank(10.0, [[0, "recv", 100, 10.1, 10.4, False]]),
        2: _rank(10.0, [[1, "recv", 100, 10.45, 11.0, False]], {"transfer": 0.3}),
    }
    m = iteration_metrics(ranks, shared_clock=True)
    assert m["latency_s"] == pytest.approx(1.0)
    assert m["rank_latency_s"] == pytest.approx({0: 0.9, 1: 0.4, 2: 1.0})
    assert m["skew_s"] == pytest.approx(0.6)
    assert m["idle_s"] == pytest.approx({0: 0.4, 1: 0.7, 2: 0.45})
    assert m["idle_fraction"] == pytest.approx(1.55 / 3)
    assert m["active_groups"] == 1
    assert m["delivered_bytes"] == 200
    assert m["max_inflight_bytes"] == {0: 100, 1: 100, 2: 100}
    assert m["phases_s"] == {"transfer": 0.3}
    # group 1 posted before group 0 finished: two groups active at once
    ranks[2]["transfers"][0][3] = 10.35
    assert iteration_metrics(ranks, shared_clock=True)["active_groups"] == 2


def test_unshared_clocks_are_aligned_at_each_ranks_barrier() -> None:
    ranks = {0: _rank(0.0, [[0, "bcast_root", 10, 0.1, 0.2, False]]),
             1: _rank(500.0, [[0, "bcast", 10, 500.1, 500.2, False]]),
             2: _rank(-40.0, [[1, "bcast", 10, -39.85, -39.7, False]])}
    assert iteration_metrics(ranks, shared_clock=False)["active_groups"] == 2
    m = iteration_metrics(ranks, shared_clock=False)
    assert m["latency_s"] == pytest.approx(0.3)
    assert m["delivered_bytes"] == 20  # the root's own copy is not delivered


def test_aggregate_over_iterations() -> None:
    its = []
    for lat in (1.0, 2.0, 3.0):
        its.append({"latency_s": lat, "skew_s": lat / 10, "idle_s": {0: 0.0, 1: lat / 2},
                    "idle_fraction": lat / 8,
                    "max_inflight_bytes": {0: 10, 1: 20}, "active_groups": 2, "delivered_bytes": 4e9,
                    "phases_s": {"control": lat / 4}})
    a = aggregate(its)
    assert a["latency_s"]["p50"] == 2.0 and a["latency_s"]["max"] == 3.0
    assert a["gb_per_s"] == pytest.approx(2.0)
    assert a["idle_s"] == {0: 0.0, 1: 1.0}
    assert a["idle_fraction"] == pytest.approx(0.25)
    assert a["max_inflight_bytes_any_rank"] == 20 and a["max_active_groups"] == 2
    assert a["phases_s"] == {"control": 0.5}
    with pytest.raises(ValueError):
        aggregate([])


def test_engine_pause_is_the_longest_engine_groups_receive_span() -> None:
    from shardsync.bench.metrics import iteration_metrics

    # rows: (group, kind, bytes, start, end); group 0 receives over 1..4, group 1 over 2..3
    ranks = {0: {"t0": 0.0, "phases": {}, "transfers": [(0, "send", 8, 1.0, 2.0), (1, "send", 8, 2.0, 3.0)]},
             1: {"t0": 0.0, "phases": {}, "transfers": [(0, "recv", 8, 1.5, 4.0)]},
             2: {"t0": 0.0, "phases": {}, "transfers": [(1, "recv", 8, 2.0, 3.0)]}}
    assert iteration_metrics(ranks, shared_clock=True)["engine_pause_s"] == pytest.approx(3.0)
