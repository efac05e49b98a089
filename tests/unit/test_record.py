"""An update record as the flat dict RL trainers log (``UpdateRecord.metrics``)."""

from __future__ import annotations

import pytest

from shardsync.mode import Mode
from shardsync.runtime.ledger import UpdateResult
from shardsync.runtime.record import UpdateRecord


def _record(**kw) -> UpdateRecord:
    engine = UpdateResult(version=7, mode=Mode.BROADCAST, ok=True, pause_s=0.004)
    fields = dict(version=7, mode="broadcast", fallback_reason="engine TP 3 splits the vocab unevenly", ok=True,
                  rank=0, bytes_sent=100, buckets=3, phases={"plan": 0.0, "pack": 0.1, "transfer": 0.2, "total": 0.5},
                  link_bytes={"t0->e0": 3 * 10**8, "t1->e0": 2 * 10**8}, engines=[engine])
    return UpdateRecord(**{**fields, **kw})  # type: ignore[arg-type]


def test_metrics_are_one_flat_dict_in_the_names_rl_trainers_log() -> None:
    m = _record().metrics()
    assert m["perf/update_weights_time"] == 0.5
    assert m["perf/update_weights_transfer_time"] == 0.2 and "perf/update_weights_total_time" not in m
    assert m["perf/update_weights_engine_pause_time"] == 0.004
    assert m["perf/update_weights_bytes"] == 5 * 10**8 and m["perf/update_weights_busiest_link_bytes"] == 3 * 10**8
    assert m["perf/update_weights_gbps"] == pytest.approx(1.0)
    assert m["perf/update_weights_path"] == "broadcast" and m["perf/update_weights_ok"] == 1.0
    assert m["perf/update_weights_fallback_reason"].startswith("engine TP 3")


def test_numbers_only_under_another_prefix() -> None:
    m = _record(link_bytes={}, ok=False).metrics("timing_s/", text=False)
    assert all(isinstance(v, int | float) for v in m.values()) and all(k.startswith("timing_s/") for k in m)
    assert m["timing_s/update_weights_bytes"] == 100  # a rank without the plan's links: its own bytes
    assert m["timing_s/update_weights_ok"] == 0.0
