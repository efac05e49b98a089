"""The pair rule: tensors an engine fuses travel together.  An engine tensor cut from several
logical tensors (SGLang's ``fused_qkv_a_proj_with_mqa`` from ``q_a_proj`` and
``kv_a_proj_with_mqa``, the indexer's ``wk_weights_proj``, QKV, gate/up, expert stacks) must
never be loaded half: SGLang's DeepSeek loader keeps one half of q_a / kv_a only until the end
of a ``load_weights`` call and silently drops an unpaired one.

shardsync guarantees it twice.  Every plan delivers, within one update, every element of every
fused tensor an engine rank holds, whatever the bucket boundaries (buckets are per link, and
the halves often come from different trainer ranks, so a bucket alone cannot promise it); and
nothing is loaded per bucket: a receiver writes buckets into the engine's own tensors (or into
staging) and only a commit, after the last bucket, makes them served or hands an engine's
loader the whole update in one call.  Checked here over every family's plans and buckets, and
on the loader path."""

from __future__ import annotations

from collections import defaultdict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.layout.engine import variant_choices
from shardsync.plan import make_buckets
from shardsync.presets import PRESETS
from shardsync.receiver.destination import Loader, Slice
from shardsync.topology import Topology

TINY = sorted(n for n in PRESETS if n.startswith("tiny-"))
BUDGET = 4096  # bytes: many buckets, large copies split across them


def fused_groups(layout_rank) -> dict[str, set[str]]:
    """An engine rank's tensors cut from more than one logical tensor -> their logical sources."""
    sources: dict[str, set[str]] = defaultdict(set)
    for p in layout_rank.pieces:
        sources[p.local].add(p.logical)
    return {local: logical for local, logical in sources.items() if len(logical) > 1}


@st.composite
def topologies(draw) -> Topology:
    spec = PRESETS[draw(st.sampled_from(TINY))]
    moe = spec.is_moe
    trainer = MegatronParallel(tp=draw(st.sampled_from([1, 2])), pp=draw(st.sampled_from([1, 2])),
                               ep=draw(st.sampled_from([1, 2])) if moe else 1, etp=1 if moe else None,
                               dp=2 if moe else 1, norm_names=draw(st.sampled_from(["fused", "separate"])))
    tp = draw(st.sampled_from([1, 2, 4]))
    engine = EngineParallel(tp=tp, ep=draw(st.sampled_from([e for e in (1, 2) if e <= tp])) if moe else 1)
    engine = EngineParallel(tp=engine.tp, ep=engine.ep, variants=draw(st.sampled_from(variant_choices(spec, engine))))
    return Topology(spec, trainer, (engine,))


def _coverage(plan, buckets) -> dict[tuple[int, str], torch.Tensor]:
    """Per destination tensor: how many times the buckets write each of its elements."""
    out: dict[tuple[int, str], torch.Tensor] = {}
    for b in buckets:
        for c in b.copies:
            key = (c.dst, c.dst_local)
            if key not in out:
                out[key] = torch.zeros(plan.dst.ranks[c.dst].tensor(c.dst_local).shape, dtype=torch.int16)
            out[key][tuple(slice(o, o + n) for o, n in zip(c.dst_offsets, c.sizes, strict=True))] += 1
    return out


def _whole_once(coverage: dict[tuple[int, str], torch.Tensor], key: tuple[int, str]) -> bool:
    return key in coverage and bool((coverage[key] == 1).all())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topologies())
def test_every_fused_engine_tensor_arrives_whole_within_one_update(topo: Topology) -> None:
    """p2p: the buckets to an engine rank write every element of each of its fused tensors exactly
    once, from every logical source it is cut from.  Broadcast: the buckets bring every source
    whole to every engine rank, and the rank-local narrow fills each fused tensor exactly once."""
    try:
        p2p, broadcast = topo.p2p_plan, topo.broadcast_plan
    except ValueError:  # a layout that cannot exist (heads not dividing TP...): nothing to plan
        return
    engine = topo.engines_layout
    got = _coverage(p2p, make_buckets(p2p, BUDGET))
    whole = _coverage(broadcast, make_buckets(broadcast, BUDGET))
    narrow = topo.narrow_plan(0)
    narrowed = _coverage(narrow, make_buckets(narrow, BUDGET))
    checked = 0
    for r, rank in enumerate(engine.ranks):
        for local, sources in fused_groups(rank).items():
            assert _whole_once(got, (r, local)), (topo.spec.name, r, local)
            members = {c.logical for c in p2p.copies_to(r) if c.dst_local == local}
            assert members == sources, (local, members, sources)
            assert all(_whole_once(whole, (r, name)) for name in sources), (topo.spec.name, r, local)
            assert _whole_once(narrowed, (r, local)), (topo.spec.name, r, local)
            checked += 1
    assert checked > 0  # every family fuses something (QKV at least)


def test_a_loader_gets_the_whole_update_in_one_call() -> None:
    """The loader path (vLLM's reload, SGLang's own ``load_weights``): however many buckets wrote
    the staging tensors, ``commit`` calls the engine's loader once, with every slice of every
    fused pair (GLM-5's q_a / kv_a and the indexer's wk / weights_proj among them)."""
    topo = Topology(PRESETS["tiny-glm5"], MegatronParallel(tp=2), (EngineParallel(tp=2),))
    rank = topo.engines_layout.ranks[1]
    calls: list[list[Slice]] = []
    loader = Loader(rank, topo.engines_layout.logical, lambda slices: calls.append(list(slices)),
                    dtype=torch.float32)
    for b in make_buckets(topo.p2p_plan, BUDGET, topo.p2p_plan.copies_to(1)):  # what the receive writes
        for c in b.copies:
            box = tuple(slice(o, o + n) for o, n in zip(c.dst_offsets, c.sizes, strict=True))
            loader.tensors()[c.dst_local][box] = 1.0
    assert calls == []  # nothing loads per bucket
    loader.commit()
    assert len(calls) == 1
    names = {s.name for s in calls[0]}
    a = "model.layers.1.self_attn."
    for local, sources in fused_groups(rank).items():
        assert sources <= names, local
    assert {a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", a + "indexer.wk.weight",
            a + "indexer.weights_proj.weight"} <= names
