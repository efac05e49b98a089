"""Engine pipeline stages (``EngineParallel.pp``, SGLang's ``--pp-size``): each stage's TP
ranks hold its layers under their global names, the embedding on the first stage, norm and
``lm_head`` on the last (every stage for the families SGLang builds it on), and every plan
into such an engine covers every element it holds exactly once."""

from __future__ import annotations

import pytest

from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout
from shardsync.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.views import Host


def _sglang_split(layers: int, stage: int, stages: int) -> tuple[int, int]:
    """SGLang's get_pp_indices, written out: the last ``layers % stages`` stages get one more."""
    base, rem = divmod(layers, stages)
    sizes = [base + (s >= stages - rem) for s in range(stages)]
    return sum(sizes[:stage]), sum(sizes[:stage + 1])


@pytest.mark.parametrize(("layers", "stages"), [(4, 2), (4, 3), (5, 3), (7, 4), (36, 5)])
def test_stage_split_is_sglang_even_split(layers, stages) -> None:
    par = EngineParallel(pp=stages)
    got = [par.stage_layers(layers, s) for s in range(stages)]
    assert [(r.start, r.stop) for r in got] == [_sglang_split(layers, s, stages) for s in range(stages)]
    assert list(EngineParallel(pp=2, pp_layers=(1, 3)).stage_layers(4, 1)) == [1, 2, 3]


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_stages_hold_their_layers_and_ends(model) -> None:
    spec = PRESETS[model]
    lay = engine_layout(spec, EngineParallel(tp=2, pp=2, dtype="float32"))
    assert [r.label for r in lay.ranks] == ["pp0tp0", "pp0tp1", "pp1tp0", "pp1tp1"]
    for i, rank in enumerate(lay.ranks):
        stage, names = i // 2, {t.name for t in rank.tensors}
        layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
        assert layers == set(range(2 * stage, 2 * stage + 2)), (i, layers)
        assert ("model.embed_tokens.weight" in names) == (stage == 0)
        assert ("model.norm.weight" in names) == (stage == 1)
        every = spec.family_table.lm_head_every_stage and not spec.tie_word_embeddings
        assert ("lm_head.weight" in names) == (stage == 1 or every), (i, names & {"lm_head.weight"})
    if spec.tie_word_embeddings:  # the last stage's own lm_head is filled from the embedding
        (head,) = [p for p in lay.ranks[2].pieces if p.local == "lm_head.weight"]
        assert head.logical == "model.embed_tokens.weight"
    build_plan(full_layout(spec, dtype="float32"), lay)  # proves every held element is written once


def test_p2p_plan_from_a_pipelined_trainer_into_a_pipelined_engine() -> None:
    spec = PRESETS["tiny-qwen3"]
    topo = Topology(spec, MegatronParallel(tp=2, pp=2), (EngineParallel(tp=2, pp=2), EngineParallel(tp=1)),
                    host=Host("sglang"))
    assert topo.num_engine_ranks == 5 and topo.engine_rank_offset(1) == 4
    assert topo.p2p_plan.copies and topo.broadcast_plan.copies
    assert topo.fingerprint("p2p") != Topology(spec, topo.trainer, (EngineParallel(tp=2), EngineParallel(tp=1)),
                                               host=Host("sglang")).fingerprint("p2p")


def test_impossible_stages_are_refused() -> None:
    spec = PRESETS["tiny-qwen3"]
    with pytest.raises(ValueError, match="exceeds the 4 layers"):
        engine_layout(spec, EngineParallel(pp=5))
    with pytest.raises(ValueError, match="pp_layers"):
        engine_layout(spec, EngineParallel(pp=2, pp_layers=(1, 2)))
