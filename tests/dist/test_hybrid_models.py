"""Gated DeltaNet hybrids in the reference models: at TP 1 against transformers'
``Qwen3NextForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (linear-attention layers, gated full
attention, zero-centred norms, the gated shared expert; the trainer's gradients too), a cached
decode (conv and recurrent state carried) against full recomputation, and parallel worlds
against the TP 1 runs: the engine splits key-head groups over TP, the trainer replicates the
linear-attention layer (slime's) and splits the rest."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.models.trainer import TrainerModel, megatron_groups
from shardsync.models.weights import random_source
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
    _inputs,
    _trainer_case,
    assert_trainer_world,
)

SPECS = ("tiny-qwen3-next", "tiny-qwen3.5-moe")
RTOL = 1e-5
ENGINE_CASES = [(2, 1), (2, 2)]  # (tp, ep)
TRAINER_CASES = [TrainerCase("tp2-te", tp=2, specs=SPECS),
                 TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1, norm_names="separate", specs=SPECS[:1])]
WORLD, WORLD_TIMEOUT_S = 2, 240


def _ids(spec: ModelSpec) -> torch.Tensor:
    return _inputs(spec)["ids"][:2]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", SPECS)
def test_engine_matches_transformers(name: str) -> None:
    spec = PRESETS[name]
    ids = _ids(spec)
    got = EngineModel.from_source(spec, random_source(spec, SEED))(ids)
    with torch.no_grad():
        want = _hf_model(spec)(ids).logits
    assert rel(got, want) <= RTOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("norm_names", ["fused", "separate"])
def test_trainer_matches_transformers(name: str, norm_names: str) -> None:
    """Logits and every gradient at TP 1 (``A_log``, ``dt_bias``, the conv and the gates included)."""
    spec = PRESETS[name]
    ids, loss_fn = _batch(_inputs(spec), 0, 1)
    hf = _hf_model(spec)
    logp = torch.log_softmax(hf(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    loss_fn(logp).backward()
    want = {n: g for n, g in _hf_grads(spec, hf).items() if g is not None}
    assert any(n.endswith("linear_attn.A_log") for n in want) and any("shared_expert_gate" in n for n in want)
    model = TrainerModel(spec, MegatronParallel(norm_names=norm_names), source=random_source(spec, SEED))
    assert rel(model.logits(ids), hf(ids).logits) <= RTOL
    model.forward_backward(ids, loss_fn)
    model.finish_grad_sync()
    assert all(n.startswith("mtp.") for n, p in model.named_parameters() if not p.requires_grad)
    got = to_hf(model.layout, 0, {n: p.grad if p.requires_grad else torch.zeros_like(p)
                                  for n, p in model.named_parameters()})
    assert {n for n in got if not n.startswith("mtp.")} == set(want)  # the MTP layer (frozen): not in transformers
    errs = {n: rel(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


def test_norms_are_zero_centred() -> None:
    """Zeroed norm weights scale by one (``1 + w``): the model still computes; the reference rows'
    zero init would give all-zero logits if a norm multiplied by ``w``."""
    spec = PRESETS["tiny-qwen3-next"]
    src = random_source(spec, SEED)
    engine = EngineModel.from_source(spec, lambda n: torch.zeros_like(src(n)) if "norm" in n and "linear_attn" not in n
                                     else src(n))
    assert engine(_ids(spec)).abs().max() > 0


@pytest.mark.parametrize("name", SPECS)
def test_cached_decode_equals_recomputing(name: str) -> None:
    """Greedy tokens with the cache (the conv's last inputs and the recurrent state carried on the
    linear layers, keys and values on the full ones) equal a full forward's argmax, step by step."""
    spec = PRESETS[name]
    engine = EngineModel.from_source(spec, random_source(spec, SEED))
    prompt = _ids(spec)[0, :6].tolist()
    (tokens, logprobs), = engine.generate([prompt], max_new_tokens=6, temperature=0.0)
    seq = list(prompt)
    for t, lp in zip(tokens, logprobs, strict=True):
        with torch.no_grad():
            last = engine(torch.tensor([seq]))[0, -1]
        assert int(last.argmax()) == t
        assert abs(float(torch.log_softmax(last, -1)[t]) - lp) <= 1e-4
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
