"""Fail-closed provenance: unsynchronized device timings or missing iterations are refused."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shardsync.bench import report
from shardsync.bench.provenance import Provenance, ProvenanceError, check
from shardsync.bench.sweep import BenchConfig
from shardsync.bench.topology import partition

OK = Provenance(backend="gloo", device="cpu", timed_transfers=40, warmup_asked=1, warmup_done=1,
                iters_asked=5, iters_measured=5)


def test_cpu_timings_with_all_iterations_pass() -> None:
    check(OK)
    check(replace(OK, backend="nccl", device="cuda:0", device_syncs=40))


@pytest.mark.parametrize(("change", "match"), [
    ({"device": "cuda:0", "backend": "nccl"}, "without a device synchronization"),
    ({"device": "cuda:1", "device_syncs": 40, "unsynced_transfers": 1}, "1 of 40"),
    ({"iters_measured": 4}, "4 measured iteration"),
    ({"warmup_done": 0}, "warm-up"),
    ({"clock": "time.time"}, "monotonic"),
    ({"incomplete_transfers": 2}, "no completion time"),
    ({"timed_transfers": 0}, "no transfer was timed"),
])
def test_unprovable_timings_are_refused(change: dict, match: str) -> None:
    with pytest.raises(ProvenanceError, match=match):
        check(replace(OK, **change), "p2p 1MiB")


def _result(prov: Provenance) -> dict:
    return {"label": "p2p 1MiB", "provenance": prov.to_json(), "metrics": {"latency_s": {}}}


def test_the_report_refuses_to_include_a_refused_result() -> None:
    cfg, lay = BenchConfig(iters=5, warmup=1), partition(3, group_size=1)
    rep = report.build(cfg, lay, [_result(OK)], {"backend": "gloo"})
    assert rep["results"][0]["provenance"]["clock"] == "time.perf_counter"
    with pytest.raises(ProvenanceError, match="refusing to report p2p 1MiB"):
        report.build(cfg, lay, [_result(OK), _result(replace(OK, iters_measured=2))], {})
