"""``shardsync bench`` end to end on a spawned 5-rank gloo world: 1 trainer, 2 engine groups of 2.

Each policy's observed concurrency (from per-transfer timestamps on every rank) must equal
its planned bound, and no rank may ever hold more bytes in flight than its credits allow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsync.bench import report
from shardsync.bench.run import prepare, run_sweep
from shardsync.bench.sweep import MiB, BenchConfig
from shardsync.bench.workload import plan_topology
from shardsync.store.rendezvous import Rendezvous
from tests.dist._world import free_port, run_world

WORLD = 5


def _bench(rank: int, cfg: BenchConfig, rdv: Rendezvous, out) -> None:
    out.put((rank, run_sweep(rank, WORLD, cfg, rdv)))


def _sweep(cfg: BenchConfig) -> list[dict]:
    rdv = Rendezvous("127.0.0.1", free_port(), WORLD, "bench-test", "gloo", 30.0)
    return run_world(_bench, WORLD, args=(cfg, rdv), timeout=90)[0]


def test_observed_concurrency_equals_each_policys_bound(tmp_path: Path) -> None:
    cfg = BenchConfig(nproc=WORLD, engine_group_size=2, transports=("broadcast", "p2p"), bucket_mb=(0.25,),
                      messages=3, credits=(1, 2), inflight_mb=(None, 0.25), windows=(1, 2), warmup=1,
                      iters=3, progress=False)
    results = _sweep(cfg)
    assert len(results) == 2 * 2 * 2 * 4
    size = MiB // 4
    expected = {"all_at_once": 2, "serialized": 1, "windowed(W=1)": 1, "windowed(W=2)": 2}
    for r in results:
        p, m = r["point"], r["metrics"]
        pol = f"windowed(W={p['window']})" if p["policy"] == "windowed" else p["policy"]
        assert r["bound_groups"] == expected[pol], r["label"]
        assert m["max_active_groups"] == r["bound_groups"], r["label"]
        cap = min(p["credits"] * size, p["inflight_cap_bytes"] or p["credits"] * size)
        assert r["inflight_bound_bytes"] == cap
        assert m["max_inflight_bytes_any_rank"] <= cap, r["label"]
        assert m["max_inflight_bytes"][0] == cap, f"{r['label']}: the sender fills its window"
        assert m["delivered_bytes"] == 4 * 3 * size
        assert m["latency_s"]["p50"] > 0 and m["iterations"] == 3
        assert r["provenance"]["iters_measured"] == 3 and r["provenance"]["clock_domain"] == "host"
    lay = prepare(cfg, WORLD).layout
    rep = report.build(cfg, lay, results, {"backend": "gloo", "device": "cpu"})
    text = report.table(rep)
    assert text.count("\n") == len(results) + 2 and "windowed(W=1)" in text
    paths = report.plot(rep, tmp_path)
    assert [p.name for p in paths] == ["latency.png", "inflight.png"]
    assert all(p.stat().st_size > 1000 for p in paths)


@pytest.mark.parametrize("transport", ["p2p", "broadcast"])
def test_plan_workload_moves_the_plans_bytes_with_stride_and_no_reuse(transport: str) -> None:
    cfg = BenchConfig(nproc=WORLD, engine_group_size=2, transports=(transport,), bucket_mb=(1.0,),
                      policies=("all_at_once", "serialized"), stride_us=(500.0,), reuse=(False,),
                      model="tiny-qwen3", trainer_tp=2, warmup=0, iters=2, progress=False)
    results = _sweep(cfg)
    topo = plan_topology("tiny-qwen3", 2, 2)
    per_group = (topo.p2p_plan.total_bytes if transport == "p2p"
                 else 2 * topo.broadcast_plan.bytes_per_dst()[0])
    for r in results:
        m = r["metrics"]
        assert m["delivered_bytes"] == 2 * per_group
        assert m["max_active_groups"] <= r["bound_groups"]
        for it in r["traces"]:  # the sender holds group 1's go until 500 us after group 0 started
            go = {g: (t_in, t_out) for kind, g, t_in, t_out in it[0]["control"] if kind == "go"}
            if r["point"]["policy"] == "all_at_once":
                assert go[1][0] - go[0][1] >= 500e-6
        allocated = r["pool_allocated_bytes"]
        assert allocated[1] >= per_group // 2, "reuse off: every transfer allocated its buffer"
