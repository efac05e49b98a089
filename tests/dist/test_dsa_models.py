"""DeepSeek sparse attention in the reference models: at TP 1 against transformers'
``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` (the indexer's top-k smaller than the
sequence, so its choice shapes every layer; the trainer's gradients too), GLM-5's shared layers,
parallel worlds against the TP 1 runs, and a KV-cached decode (the indexer's keys cached) against
full recomputation.  ``random_source`` gives ``weights_proj`` bfloat16-representable values:
SGLang's layout, which the reference engine holds, keeps it in bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.weights import TensorSource, random_source
from shardsync.presets import PRESETS
from shardsync.spec import ModelSpec
from tests.dist._compare import rel, to_hf
from tests.dist._world import free_port, run_world
from tests.dist.test_moe_models import (
    SEED,
    TrainerCase,
    _batch,
    _hf_grads,
    _hf_model,
    _trainer_case,
    assert_trainer_world,
)

SPECS = ("tiny-glm5", "tiny-deepseek-v32")
SHARED = PRESETS["tiny-glm5"].replace(name="tiny-glm5-shared", index_shared_layers=(2,))
RTOL = 1e-5
ENGINE_CASES = [(2, 1), (2, 2)]  # (tp, ep)
TRAINER_CASES = [TrainerCase("tp2-te", tp=2, specs=SPECS), TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1,
                                                                        norm_names="separate", specs=SPECS[:1])]
WORLD, WORLD_TIMEOUT_S = 2, 240


def _source(spec: ModelSpec) -> TensorSource:
    src = random_source(spec, SEED)
    w = src("model.layers.1.self_attn.indexer.weights_proj.weight")
    assert torch.equal(w, w.to(torch.bfloat16).float())  # what the engine holds, exactly
    return src


def _ids(spec: ModelSpec) -> torch.Tensor:
    """Longer than the indexer's top-k (8): most queries attend to a chosen subset."""
    return torch.randint(0, spec.vocab_size, (3, 23), generator=torch.Generator().manual_seed(5))


def _inputs(spec: ModelSpec) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = _ids(spec)
    b, s = ids.shape
    return {"ids": ids, "old": -3.0 + 0.1 * torch.randn(b, s - 1, generator=g),
            "adv": torch.randn(b, generator=g), "mask": torch.rand(b, s - 1, generator=g) > 0.2}


@pytest.mark.parametrize("spec", [PRESETS[n] for n in SPECS] + [SHARED], ids=lambda s: s.name)
def test_engine_matches_transformers(spec: ModelSpec) -> None:
    ids = _ids(spec)
    got = EngineModel.from_source(spec, _source(spec))(ids)
    with torch.no_grad():
        want = _hf_model(spec, _source(spec))(ids).logits
    assert rel(got, want) <= RTOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_indexer_choice_matters() -> None:
    """Against the same model attending densely (top-k above the sequence), the logits move: the
    comparisons above would catch an indexer that chose wrong."""
    spec = PRESETS["tiny-glm5"]
    ids = _ids(spec)
    sparse = EngineModel.from_source(spec, _source(spec))(ids)
    dense = EngineModel.from_source(spec.replace(index_topk=64), _source(spec))(ids)
    assert rel(sparse, dense) > 1e-3


@pytest.mark.parametrize("spec", [PRESETS[n] for n in SPECS] + [SHARED], ids=lambda s: s.name)
@pytest.mark.parametrize("norm_names", ["fused", "separate"])
def test_trainer_matches_transformers(spec: ModelSpec, norm_names: str) -> None:
    """Logits and every gradient at TP 1; the indexer takes none (transformers runs it under no_grad)."""
    ids, loss_fn = _batch(_inputs(spec), 0, 1)
    hf = _hf_model(spec, _source(spec))
    logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_fn(logp).backward()
    want = {n: g for n, g in _hf_grads(spec, hf).items() if g is not None}
    assert not any(".indexer." in n for n in want)
    model = TrainerModel(spec, MegatronParallel(norm_names=norm_names), source=_source(spec))
    assert rel(model.logits(ids), hf(ids).logits) <= RTOL
    model.forward_backward(ids, loss_fn)
    model.finish_grad_sync()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert {n for n in frozen if ".indexer." in n} == {n for n, _ in model.named_parameters() if ".indexer." in n}
    got = to_hf(model.layout, 0, {n: p.grad for n, p in model.named_parameters()})
    errs = {n: rel(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


def test_a_pipeline_stage_cannot_start_on_a_shared_layer() -> None:
    with pytest.raises(ValueError, match="move the stage boundary"):
        TrainerModel(SHARED, MegatronParallel(pp=2, pp_layers=(2, 2)), rank=1, source=_source(SHARED))


@pytest.mark.parametrize("spec", [PRESETS["tiny-glm5"], SHARED], ids=lambda s: s.name)
def test_cached_decode_equals_recomputing(spec: ModelSpec) -> None:
    """Greedy tokens with the KV cache (the indexer's keys cached too) equal the argmax of a full
    forward over the sequence so far, step by step, past the top-k."""
    engine = EngineModel.from_source(spec, _source(spec))
    prompt = _ids(spec)[0, :6].tolist()
    (tokens, _), = engine.generate([prompt], max_new_tokens=8, temperature=0.0)
    seq = list(prompt)
    for t in tokens:
        with torch.no_grad():
            assert int(engine(torch.tensor([seq]))[0, -1].argmax()) == t
        seq.append(t)


def _world(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[Any, Any] = {}
    refs: dict[Any, Any] = {}
    try:
        for case in TRAINER_CASES:
            groups = megatron_groups(case.par, timeout_s=60, moe=True)
            for name in case.specs:
                spec = PRESETS[name]
                results[case.label, name] = _trainer_case(spec, case, groups, _inputs(spec), refs)
        for tp, ep in ENGINE_CASES:
            for name in SPECS:
                spec = PRESETS[name]
                want = EngineModel.from_source(spec, random_source(spec, SEED))(_ids(spec))
                engine = EngineModel.from_source(spec, random_source(spec, SEED), rank, tp, dist.group.WORLD, ep=ep)
                results[tp, ep, name] = rel(engine(_ids(spec)), want)
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world() -> dict[int, dict[Any, Any]]:
    return run_world(_world, WORLD, args=(WORLD, free_port()), timeout=WORLD_TIMEOUT_S)


@pytest.mark.parametrize(("case", "name"), [(c, n) for c in TRAINER_CASES for n in c.specs],
                         ids=lambda x: x.label if isinstance(x, TrainerCase) else x)
def test_trainer_worlds_match_tp1(world, case: TrainerCase, name: str) -> None:
    assert_trainer_world(world, case, name, RTOL)


@pytest.mark.parametrize(("tp", "ep", "name"), [(tp, ep, n) for tp, ep in ENGINE_CASES for n in SPECS])
def test_engine_worlds_match_tp1(world, tp: int, ep: int, name: str) -> None:
    for r in range(tp):
        assert world[r][tp, ep, name] <= RTOL, (r, world[r][tp, ep, name])
