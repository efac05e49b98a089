"""Fabric lower bounds: the busiest endpoint's bytes over its bandwidth, recomputed here from
the plan's links, and the CLI that prints them."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict

import pytest

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.plan.fabric import FABRICS, fabric, lower_bounds
from shardsync.presets import PRESETS
from shardsync.topology import Topology

TOPO = Topology(PRESETS["tiny-qwen3-moe"], MegatronParallel(tp=1, dp=4, ep=4), (EngineParallel(tp=2),) * 2)


def test_per_gpu_bound_is_the_busiest_endpoint() -> None:
    f = FABRICS["ib400"]
    sent, got = defaultdict(int), defaultdict(int)
    for (s, d), b in TOPO.p2p_plan.link_bytes.items():
        sent[s] += b
        got[d] += b
    busiest = max([*sent.values(), *got.values()])
    p2p, bcast = lower_bounds(TOPO, f, 1 << 20)
    assert p2p["lower_bound_s"] == pytest.approx(busiest / (f.gpu_gbytes_s * 1e9))
    # broadcast: a receiver takes in every byte of the model once
    model_bytes = max(TOPO.broadcast_plan.bytes_per_dst().values())
    assert bcast["lower_bound_s"] == pytest.approx(model_bytes / (f.gpu_gbytes_s * 1e9))
    assert p2p["lower_bound_s"] < bcast["lower_bound_s"]


def test_pooled_nics_bound_by_the_busiest_node() -> None:
    f = FABRICS["8x400g"]
    # all 4 trainer ranks on node 0 send the whole model once per engine (2 engines)
    p2p, _ = lower_bounds(TOPO, f, 1 << 20)
    total = TOPO.p2p_plan.total_bytes
    assert p2p["lower_bound_s"] == pytest.approx(total / (f.node_gbytes_s * 1e9))
    assert "node trainer0" in p2p["binds"] or "node engine" in p2p["binds"]


def test_unknown_fabric_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="nvlink4"):
        fabric("carrier-pigeon")


def test_plan_cli_prints_the_bounds() -> None:
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "plan", "--model", "Qwen3-4B", "--trainer-tp", "2",
                        "--engine-tp", "4", "--fabric", "nvlink4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stdout.splitlines() if ">=" in ln]
    assert [ln.split()[0] for ln in lines] == ["p2p", "broadcast"], r.stdout
