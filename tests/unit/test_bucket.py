"""Buckets (``plan/bucket.py``) of FP8 plans: a bucket never holds a block of e4m3 words without
its scale.  A block's scale comes from the holder its words come from, also where the trainer's
DP replicas both hold them (``plan.build_plan``'s ``riders``), and the words of a copy larger
than the budget are cut at whole block rows, each with its scale rows; every copy is still
covered exactly once."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.layout.fsdp2 import Fsdp2Parallel
from shardsync.plan import make_buckets
from shardsync.plan.plan import Plan
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.views import views_of
from tests.fp8_straddle import STRADDLE

DENSE, MOE = PRESETS["tiny-qwen3-fp8"], PRESETS["tiny-qwen3-moe-fp8"]
CASES = {  # spec, trainer, engine, format
    "tp2": (DENSE, MegatronParallel(tp=2), EngineParallel(tp=2), "fp8"),
    "dp2": (DENSE, MegatronParallel(tp=1, dp=2), EngineParallel(tp=2), "fp8"),  # two holders of every block
    "moe-ep2": (MOE, MegatronParallel(tp=2, ep=2, etp=1), EngineParallel(tp=2, ep=2), "fp8"),
    "straddle": (STRADDLE, MegatronParallel(tp=2), EngineParallel(tp=1), "fp8"),  # cells
    "fsdp2": (DENSE, Fsdp2Parallel(shard=3), EngineParallel(tp=2), "fp8"),
    "channel": (DENSE, MegatronParallel(tp=1, dp=2), EngineParallel(tp=2), "fp8-channel"),
}
BUDGETS = [1 << 20, 64 << 10, 4 << 10]  # 4 KiB: below one block row of words (128 x 32 int32 = 16 KiB)


def _topo(case: str) -> Topology:
    spec, trainer, engine, fmt = CASES[case]
    return Topology(spec, trainer, (dataclasses.replace(engine, dtype=spec.dtype),), views=views_of(fmt))


def _orphans(plan: Plan, budget: int) -> tuple[int, int]:
    """(words copies in a bucket without the scales of all their blocks, words copies)."""
    orphans = words = 0
    for b in make_buckets(plan, budget):
        scales = Counter()
        for c in b.copies:
            scales[c.logical, c.logical_offsets, c.sizes] += 1
        for c in b.copies:
            s = plan.riders.get(c.logical)
            if s is None:
                continue
            words += 1
            (r, w), (n, m) = c.logical_offsets, c.sizes
            first = (r // s.rows, w // s.cols)
            box = (-(-(r + n) // s.rows) - first[0], -(-(w + m) // s.cols) - first[1])
            orphans += scales[s.name, first, box] == 0
    return orphans, words


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bucket_never_holds_a_block_without_its_scale(case: str, budget: int) -> None:
    topo = _topo(case)
    assert topo.riders
    for plan in (topo.p2p_plan, topo.broadcast_plan, topo.narrow_plan(0)):
        orphans, words = _orphans(plan, budget)
        assert words > 0 and orphans == 0, (orphans, words)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("case", ["dp2", "straddle", "channel"])
def test_buckets_cover_every_copy_exactly_once(case: str, budget: int) -> None:
    plan = _topo(case).p2p_plan
    got: Counter = Counter()
    for b in make_buckets(plan, budget):
        assert b.offsets == tuple(sorted(b.offsets))
        ends = [o + c.numel * plan.width(c.logical) for o, c in zip(b.offsets, b.copies, strict=True)]
        assert all(e <= o for e, o in zip(ends, b.offsets[1:], strict=False)) and ends[-1] == b.numel  # no overlap
        assert b.numel <= budget // plan.itemsize or len({c.logical for c in b.copies}) <= 2  # a block row alone
        for c in b.copies:
            got[c.src, c.dst, c.logical] += c.numel
    want: Counter = Counter()
    for c in plan.copies:
        want[c.src, c.dst, c.logical] += c.numel
    assert got == want


def test_a_scale_comes_from_the_holder_of_its_words() -> None:
    plan = _topo("dp2").p2p_plan  # every block held by both DP replicas
    src = {(c.dst, c.logical, c.logical_offsets): c.src for c in plan.copies}
    pairs = 0
    for c in plan.copies:
        s = plan.riders.get(c.logical)
        if s is not None:
            first = (c.logical_offsets[0] // s.rows, c.logical_offsets[1] // s.cols)
            assert src[c.dst, s.name, first] == c.src, c.logical
            pairs += 1
    assert pairs > 0
    assert len({c.src for c in plan.copies}) == 2  # both replicas still send (the load is shared)
