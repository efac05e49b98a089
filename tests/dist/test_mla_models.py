"""Multi-head latent attention in the reference models: at TP 1 against ``transformers``'
``DeepseekV3ForCausalLM`` / ``Glm4MoeLiteForCausalLM`` (in process: yarn rope, its softmax
scale, the q down projection or ``q_proj``; the trainer's gradients too, in both Megatron
layer specs), then parallel worlds against the TP 1 runs (engine TP 2 and 4 with EP 1 and 2;
trainer TP 2 in both specs, EP over TP, EP over DP with PP 2), and a KV-cached greedy decode
against full recomputation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.weights import random_source
from shardsync.spec import ModelSpec
from shardsync.presets import PRESETS
from tests.dist._compare import rel, to_hf
from tests.dist._world import free_port, run_world
from tests.dist.test_moe_models import (
    SEED,
    TrainerCase,
    _batch,
    _hf_grads,
    _hf_model,
    _inputs,
    _trainer_case,
    assert_trainer_world,
)

SPECS = ("tiny-deepseek-v3", "tiny-deepseek-v3-q-proj", "tiny-glm4-moe-lite")
RTOL = 1e-5
ENGINE_CASES = [(2, 1), (2, 2), (4, 1), (4, 2)]  # (tp, ep)
TRAINER_CASES = [
    TrainerCase("tp2-te", tp=2, specs=SPECS[:2]),
    TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1, norm_names="separate", specs=SPECS),
    TrainerCase("pp2-dp2-ep2", pp=2, dp=2, ep=2, specs=SPECS[:1]),
]
WORLD, WORLD_TIMEOUT_S = 4, 240


def _ids(spec: ModelSpec) -> torch.Tensor:
    return torch.randint(0, spec.vocab_size, (3, 11), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("name", SPECS)
def test_engine_matches_transformers(name: str) -> None:
    spec = PRESETS[name]
    ids = _ids(spec)
    got = EngineModel.from_source(spec, random_source(spec, SEED))(ids)
    with torch.no_grad():
        want = _hf_model(spec)(ids).logits
    assert rel(got, want) <= RTOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def _world(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[Any, Any] = {}
    refs: dict[Any, Any] = {}
    try:
        for case in TRAINER_CASES:
            groups = megatron_groups(case.par, timeout_s=60, moe=True)
            for name in case.specs:
                if groups.rank is not None:
                    spec = PRESETS[name]
                    results[case.label, name] = _trainer_case(spec, case, groups, _inputs(spec), refs)
        wants = {n: EngineModel.from_source(PRESETS[n], random_source(PRESETS[n], SEED))(_ids(PRESETS[n]))
                 for n in SPECS}
        for tp, ep in ENGINE_CASES:
            group = dist.new_group(list(range(tp)))
            for name in SPECS:
                if rank < tp:
                    spec = PRESETS[name]
                    engine = EngineModel.from_source(spec, random_source(spec, SEED), rank, tp, group, ep=ep)
                    results[tp, ep, name] = rel(engine(_ids(spec)), wants[name])
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


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("norm_names", ["fused", "separate"])
def test_trainer_matches_transformers(name: str, norm_names: str) -> None:
    """Logits and every gradient at TP 1, in either Megatron layer spec."""
    spec = PRESETS[name]
    ids, loss_fn = _batch(_inputs(spec), 0, 1)
    hf = _hf_model(spec)
    logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_fn(logp).backward()
    want = _hf_grads(spec, hf)
    model = TrainerModel(spec, MegatronParallel(norm_names=norm_names), source=random_source(spec, SEED))
    assert rel(model.logits(ids), hf(ids).logits) <= RTOL
    model.forward_backward(ids, loss_fn)
    model.finish_grad_sync()
    got = to_hf(model.layout, 0, {n: p.grad for n, p in model.named_parameters()})
    assert set(want) <= set(got)
    errs = {n: rel(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    assert any("kv_b_proj" in n for n in errs) and any("q_" in n for n in errs)


@pytest.mark.parametrize("name", SPECS[:2])
def test_cached_decode_equals_recomputing(name: str) -> None:
    """Greedy tokens with the KV cache (keys nope + rope, values v wide) equal the argmax of a
    full forward over the sequence so far, step by step."""
    spec = PRESETS[name]
    engine = EngineModel.from_source(spec, random_source(spec, SEED))
    prompt = _ids(spec)[0].tolist()
    (tokens, _), = engine.generate([prompt], max_new_tokens=6, temperature=0.0)
    seq = list(prompt)
    for t in tokens:
        with torch.no_grad():
            assert int(engine(torch.tensor([seq]))[0, -1].argmax()) == t
        seq.append(t)


def test_trainer_holds_the_mtp_layer_frozen() -> None:
    """The MTP layer travels with the model (its megatron-core names, filled from the
    checkpoint) but the RL loss does not train it: an optimizer step leaves it unchanged."""
    spec = PRESETS["tiny-deepseek-v3"]
    model = TrainerModel(spec, MegatronParallel(norm_names="separate"), source=random_source(spec, SEED))
    mtp = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mtp.layers.0.")}
    assert {"mtp.layers.0.enorm.weight", "mtp.layers.0.eh_proj.weight", "mtp.layers.0.final_layernorm.weight",
            "mtp.layers.0.transformer_layer.mlp.router.expert_bias"} <= set(mtp)
    assert torch.equal(mtp["mtp.layers.0.eh_proj.weight"], random_source(spec, SEED)("model.layers.4.eh_proj.weight"))
    ids, loss_fn = _batch(_inputs(spec), 0, 1)
    model.forward_backward(ids, loss_fn)
    model.optimizer_step()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in mtp.items())
    assert not torch.equal(after["decoder.layers.1.mlp.router.weight"], random_source(spec, SEED)(
        "model.layers.1.mlp.gate.weight"))  # the model itself trained
