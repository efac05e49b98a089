"""Coalesced strided copies of the mapped transport equal the plan's copies one by one."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.plan.local import allocate, execute_local
from shardsync.spec import PRESETS, load_spec
from shardsync.topology import Topology
from shardsync.transport.mapped import coalesce, compile_runs, copy_pairs


@pytest.mark.parametrize("model,ttp,etp,dtype", [("tiny-qwen3", 1, 1, "float32"), ("tiny-qwen3", 2, 1, "bfloat16"),
                                                 ("tiny-qwen2", 1, 2, "bfloat16"), ("tiny-llama", 2, 4, "float32"),
                                                 ("tiny-qwen3", 4, 2, "bfloat16")])
def test_runs_copy_exactly_what_the_plan_copies(model: str, ttp: int, etp: int, dtype: str) -> None:
    """Same dtype both sides (bf16: copied as 8-byte words) and fp32 trainer -> bf16 engine."""
    spec = PRESETS[model].replace(dtype=dtype)
    topo = Topology(spec, MegatronParallel(tp=ttp, dtype=dtype), (EngineParallel(tp=etp, dtype=dtype),))
    plan = topo.p2p_plan
    sources = [load_rank(topo.trainer_layout, r, random_source(spec, seed=5)) for r in range(ttp)]
    expected = execute_local(plan, sources)
    for e in range(etp):
        got = allocate(plan, e)
        for t in range(ttp):
            copies = [c for c in plan.copies if c.dst == e and c.src == t]
            copy_pairs(compile_runs(coalesce(copies), sources[t], got))
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


def test_identity_changes_when_a_shared_cpu_tensor_is_replaced() -> None:
    """A CPU tensor's identity includes its shared-memory name, not only its address."""
    import torch.multiprocessing as tmp

    from shardsync.transport.mapped import identity

    t = torch.arange(8.0)
    plain = identity(t)
    assert plain[1] is None
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # as export does (no pickle here: nothing to leak)
    try:
        t.share_memory_()
    finally:
        tmp.set_sharing_strategy(previous)
    shared = identity(t)
    assert shared[1] is not None and shared != plain and identity(t) == shared
    t.set_(torch.arange(8.0))  # reloaded into fresh, unshared memory
    assert identity(t) != shared and identity(t)[1] is None
