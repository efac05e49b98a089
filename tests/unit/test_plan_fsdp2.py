"""FSDP2 trainer plans against an independent rule: FSDP2 shards are ``torch.chunk(t, shard)``
of each HuggingFace tensor (what ``fully_shard`` keeps; tests/dist/test_fsdp2.py checks the
layout against real DTensors).  A p2p plan from those chunks must write every engine rank's
reference tensors bitwise, the broadcast composition too, for dense and MoE specs and HSDP."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsync.layout import (
    EngineParallel,
    Fsdp2Parallel,
    concat_layouts,
    engine_layout,
    fsdp2_layout,
)
from shardsync.plan import build_plan, execute_local
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from tests.unit.reference_rules import engine_shards, synthetic_full
from tests.unit.test_plan_properties import assert_shards_equal, specs


def chunks(full: dict[str, torch.Tensor], shard: int, replicate: int) -> list[dict[str, torch.Tensor]]:
    """Rank ``rep * shard + s`` holds ``torch.chunk(t, shard)[s]`` (empty past the last chunk)."""
    out = []
    for _ in range(replicate):
        for s in range(shard):
            mine = {}
            for name, t in full.items():
                parts = torch.chunk(t, shard, dim=0)
                mine[name] = parts[s].clone() if s < len(parts) else t[:0].clone()
            out.append(mine)
    return out


@settings(max_examples=40, deadline=None)
@given(specs(), st.integers(1, 5), st.integers(1, 2), st.data())
def test_fsdp2_to_engines_matches_reference(spec, shard, replicate, data) -> None:
    full = synthetic_full(spec)
    par = Fsdp2Parallel(shard=shard, replicate=replicate)
    tps = [t for t in (1, 2, 3, 4)
           if spec.num_heads % t == 0 and (spec.num_kv_heads % t == 0 or t % spec.num_kv_heads == 0)
           and spec.intermediate_size % t == 0]
    tp = data.draw(st.sampled_from(tps))
    sources = chunks(full, shard, replicate)
    layout = fsdp2_layout(spec, par)
    for rl, src in zip(layout.ranks, sources, strict=True):  # the layout's shapes are torch.chunk's
        assert {t.name: t.shape for t in rl.tensors} == {n: tuple(v.shape) for n, v in src.items()}
    dst = concat_layouts("engine", [engine_layout(spec, EngineParallel(tp=tp))])
    plan = build_plan(layout, dst)
    assert_shards_equal(execute_local(plan, sources), engine_shards(spec, full, tp), full, f"fsdp2 {par} -> tp{tp}")
    if replicate > 1:  # replicas share the load: both replica groups send
        senders = {s for s, _ in plan.link_bytes}
        assert any(s < shard for s in senders) and any(s >= shard for s in senders)
    # broadcast: replica 0 gathers whole tensors on its first rank, which every engine rank narrows
    topo = Topology(spec, par, (EngineParallel(tp=tp),))
    gathered = execute_local(topo.gather_plan, sources)
    assert {c.src for c in topo.gather_plan.copies} <= set(range(shard))
    received = execute_local(topo.broadcast_plan, gathered)
    narrowed = [execute_local(topo.narrow_plan(0), [received[r]])[r] for r in range(tp)]
    assert_shards_equal(narrowed, engine_shards(spec, full, tp), full, "fsdp2 broadcast")
    assert all(torch.equal(received[0][n], full[n]) for n in full if n in received[0])


def test_fsdp2_moe_to_expert_parallel_engine() -> None:
    spec = PRESETS["tiny-glm4-moe"]
    full = synthetic_full(spec)
    par = Fsdp2Parallel(shard=3)
    engines = concat_layouts("engine", [engine_layout(spec, EngineParallel(tp=2, ep=2))])
    plan = build_plan(fsdp2_layout(spec, par), engines)
    got = execute_local(plan, chunks(full, 3, 1))
    want = engine_shards(spec, full, 2, ep=2)
    for r in range(2):  # the engine's 3-D stacks, addressed as 2-D views
        for name, w in want[r].items():
            assert torch.equal(got[r][name].view(w.shape), w), (r, name)


def test_plan_cli_fsdp2() -> None:
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "plan", "--model", "Qwen3-4B", "--trainer", "fsdp2",
                        "--trainer-dp", "8", "--engine-tp", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["trainer"] == {"kind": "fsdp2", "shard": 8, "replicate": 1} and report["p2p_ok"]
    p2p, bcast = (next(p for p in report["paths"] if p["path"] == k) for k in ("p2p", "broadcast"))
    full_bytes = 2 * PRESETS["Qwen3-4B"].num_parameters()
    assert bcast["per_receiver_bytes"] == full_bytes  # full_tensor() + broadcast: the whole model per rank
    assert p2p["per_receiver_bytes"] < full_bytes / 3  # each engine rank its shard (+ replicated norms)
    assert p2p["busiest_link_bytes"] < p2p["per_receiver_bytes"]  # spread over 8 senders
