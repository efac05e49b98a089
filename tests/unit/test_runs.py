"""Strided runs (what one-sided transports execute, ``transport.copies``) copy exactly what the plan's copies
copy."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.plan.local import allocate, execute_local
from shardsync.plan.runs import coalesce, compile_runs
from shardsync.presets import PRESETS, load_spec
from shardsync.topology import Topology
from shardsync.transport.copies import Copies


@pytest.mark.parametrize("model,ttp,etp,tdtype,edtype", [
    ("tiny-qwen3", 1, 1, "float32", "float32"), ("tiny-qwen3", 2, 1, "bfloat16", "bfloat16"),
    ("tiny-qwen2", 1, 2, "bfloat16", "bfloat16"), ("tiny-llama", 2, 4, "float32", "float32"),
    ("tiny-qwen3", 4, 2, "bfloat16", "bfloat16"), ("tiny-qwen3", 2, 2, "float32", "bfloat16"),
])
def test_runs_copy_exactly_what_the_plan_copies(model: str, ttp: int, etp: int, tdtype: str, edtype: str) -> None:
    """Same dtype both sides (copied as 8-byte words) and fp32 trainer -> bf16 engine (converted)."""
    spec = PRESETS[model].replace(dtype=edtype)
    topo = Topology(spec, MegatronParallel(tp=ttp, dtype=tdtype), (EngineParallel(tp=etp, dtype=edtype),))
    plan = topo.p2p_plan
    sources = [load_rank(topo.trainer_layout, r, random_source(spec, seed=5)) for r in range(ttp)]
    expected = execute_local(plan, sources)
    for e in range(etp):
        got = allocate(plan, e)
        for t in range(ttp):
            copies = [c for c in plan.copies if c.dst == e and c.src == t]
            Copies.of(compile_runs(coalesce(copies), sources[t], got)).run()
        for name, ref in expected[e].items():
            assert torch.equal(got[name], ref), f"engine rank {e}: {name} differs"


def test_qkv_groups_fuse_into_one_copy_per_piece() -> None:
    """Qwen3-4B TP1 -> TP1: Megatron's per-group QKV becomes 3 strided copies per layer,
    so a layer costs ~10 kernels instead of ~30 (metadata only: no weights allocated)."""
    spec = load_spec("Qwen3-4B")
    plan = Topology(spec, MegatronParallel(tp=1)).p2p_plan
    runs = coalesce(plan.copies)
    qkv = [r for r in runs if r.first.src_local.endswith("linear_qkv.weight")]
    assert len(qkv) == 3 * spec.num_layers
    assert all(r.n == spec.num_kv_heads for r in qkv)
    assert len(runs) <= 11 * spec.num_layers + 4 < len(plan.copies) / 2


def test_strided_host_reads_bounce_through_one_contiguous_span_per_source() -> None:
    """Megatron's interleaved QKV read as the engine's q / k / v (strided views of one host
    tensor): one span per source storage, then device-side strided copies out of it.  Run
    here with a CPU buffer; on a GPU the buffer is on the device (benchmarks/gpu_update.py)."""
    from shardsync.transport.copies import Bounce

    qkv = torch.arange(4 * 6 * 5, dtype=torch.float32).reshape(4, 6, 5)  # 4 groups x [q q q q k v] rows
    other = torch.arange(30, dtype=torch.float32).reshape(6, 5) * -1
    views = [qkv[:, :4], qkv[:, 4:5], qkv[:, 5:], other[::2]]
    dsts = [torch.zeros(v.shape) for v in views]
    groups = Bounce.groups(list(zip(dsts, views, strict=True)))
    assert len(groups) == 2 and sorted(g.span.numel() for g in groups) == [25, 4 * 6 * 5]
    buffer = torch.empty(max(g.nbytes for g in groups), dtype=torch.uint8)
    for g in groups:
        g.run(buffer)
    for d, v in zip(dsts, views, strict=True):
        assert torch.equal(d, v)
