"""The newer families' reference models in one suite, a row per family (``ROWS``): latent
attention (DeepSeek-V3, its ``q_proj`` variant, GLM-4.7-Flash), sparse attention (GLM-5, its
shared-indexer layers, DeepSeek-V3.2) and gated DeltaNet hybrids (Qwen3-Next, Qwen3.5).

Each row runs at TP 1 against ``transformers`` in process (the engine's logits; the trainer's
logits and every gradient, in both Megatron layer specs, its frozen tensors named), a KV-cached
greedy decode against full recomputation (tokens and logprobs), and, in one spawned 4-rank gloo
world shared by every row, trainer worlds (TP, EP over TP, EP over DP with PP) and engine worlds
(TP with EP) against the TP 1 runs.  A new family joins by a row; what only one family has
(an indexer whose choice matters, zero-centred norms, a frozen MTP layer) stays in its own file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardsync.family.section import Indexer
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

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL = 1e-5
WORLD, WORLD_TIMEOUT_S = 4, 480


@dataclass(frozen=True)
class Row:
    """One family in the suite: its specs (presets and variants), the specs its engine worlds and
    decodes run, its trainer and engine worlds, how long a sample is (sparse attention: past the
    indexer's top-k), the gradients the TP 1 check must see, and what its trainer keeps frozen
    (parameter-name substrings: the MTP layer, the indexer)."""

    label: str
    specs: tuple[ModelSpec, ...]
    worlds: tuple[str, ...]
    decode: tuple[str, ...]
    trainer_cases: tuple[TrainerCase, ...]
    engine_cases: tuple[tuple[int, int], ...]  # (tp, ep)
    seq: int = 12
    grads: tuple[str, ...] = ()
    frozen: tuple[str, ...] = ("mtp.",)


_MLA = ("tiny-deepseek-v3", "tiny-deepseek-v3-q-proj", "tiny-glm4-moe-lite")
_DSA = ("tiny-glm5", "tiny-deepseek-v32")
_HYBRID = ("tiny-qwen3-next", "tiny-qwen3.5-moe")
GLM5_SHARED = PRESETS["tiny-glm5"].replace(name="tiny-glm5-shared", index_shared_layers=(2,))
ROWS = (
    Row("mla", tuple(PRESETS[n] for n in _MLA), worlds=_MLA, decode=_MLA[:2],
        trainer_cases=(TrainerCase("tp2-te", tp=2, specs=_MLA[:2]),
                       TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1, norm_names="separate", specs=_MLA),
                       TrainerCase("pp2-dp2-ep2", pp=2, dp=2, ep=2, specs=_MLA[:1])),
        engine_cases=((2, 1), (2, 2), (4, 1), (4, 2)), grads=("kv_b_proj", "q_")),
    Row("dsa", (*(PRESETS[n] for n in _DSA), GLM5_SHARED), worlds=_DSA, decode=("tiny-glm5", GLM5_SHARED.name),
        trainer_cases=(TrainerCase("tp2-te", tp=2, specs=_DSA),
                       TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1, norm_names="separate", specs=_DSA[:1])),
        engine_cases=((2, 1), (2, 2)), seq=23, frozen=("mtp.", ".indexer.")),  # transformers' indexer: no_grad
    Row("hybrid", tuple(PRESETS[n] for n in _HYBRID), worlds=_HYBRID, decode=_HYBRID,
        trainer_cases=(TrainerCase("tp2-te", tp=2, specs=_HYBRID),
                       TrainerCase("tp2-ep2-etp1-local", tp=2, ep=2, etp=1, norm_names="separate",
                                   specs=_HYBRID[:1])),
        engine_cases=((2, 1), (2, 2)), grads=("linear_attn.A_log", "shared_expert_gate")),
)
SPECS = {s.name: (row, s) for row in ROWS for s in row.specs}


def source(spec: ModelSpec) -> TensorSource:
    """The random weights every side starts from; a sparse model's ``weights_proj`` holds values
    bfloat16 represents exactly (SGLang's layout, which the reference engine holds, keeps it so)."""
    src = random_source(spec, SEED)
    if spec.find(Indexer) is not None:
        w = src("model.layers.1.self_attn.indexer.weights_proj.weight")
        assert torch.equal(w, w.to(torch.bfloat16).float())
    return src


def inputs(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Four samples of the row's length: ids and the GRPO loss's old logprobs, advantages, mask."""
    seq = SPECS[spec.name][0].seq
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, spec.vocab_size, (4, seq), generator=g)
    adv = torch.randn(4, generator=g).abs() * torch.tensor([1.0, -1.0, 1.0, -1.0])  # both signs: a clipped
    return {"ids": ids, "old": -3.0 + 0.1 * torch.randn(4, seq - 1, generator=g),  # objective moves with either
            "adv": adv, "mask": torch.rand(4, seq - 1, generator=g) > 0.2}


def ids(spec: ModelSpec) -> torch.Tensor:
    return inputs(spec)["ids"][:3]



@pytest.mark.parametrize("name", list(SPECS))
def test_engine_matches_transformers(name: str) -> None:
    spec = SPECS[name][1]
    got = EngineModel.from_source(spec, source(spec))(ids(spec))
    with torch.no_grad():
        want = _hf_model(spec, source(spec))(ids(spec)).logits
    assert rel(got, want) <= RTOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("norm_names", ["fused", "separate"])
def test_trainer_matches_transformers(name: str, norm_names: str) -> None:
    """Logits and every gradient at TP 1, in either Megatron layer spec; the row's frozen tensors
    (the MTP layer; a sparse model's indexer, which transformers runs under no_grad) take none."""
    row, spec = SPECS[name]
    batch, loss_fn = _batch(inputs(spec), 0, 1)
    hf = _hf_model(spec, source(spec))
    logp = torch.log_softmax(hf(batch).logits.float(), -1)[:, :-1].gather(-1, batch[:, 1:, None]).squeeze(-1)
    loss_fn(logp).backward()
    want = {n: g for n, g in _hf_grads(spec, hf).items() if g is not None}
    assert all(any(s in n for n in want) for s in row.grads), row.grads
    model = TrainerModel(spec, MegatronParallel(norm_names=norm_names), source=source(spec))
    assert rel(model.logits(batch), hf(batch).logits) <= RTOL
    model.forward_backward(batch, loss_fn)
    model.finish_grad_sync()
    params = dict(model.named_parameters())
    frozen = {n for n, p in params.items() if not p.requires_grad}
    assert frozen == {n for n in params if any(s in n for s in row.frozen)}
    got = to_hf(model.layout, 0, {n: torch.zeros_like(p) if n in frozen else p.grad for n, p in params.items()})
    untrained = {p.logical for p in model.layout.ranks[0].pieces if p.local in frozen}
    held = {n for n, _ in hf.named_buffers()}  # transformers' buffers (a router's score-correction bias)
    assert set(got) - untrained - held == set(want)
    errs = {n: rel(got[n], want[n]) for n in want if want[n].abs().max() > 0}
    assert max(errs.values()) <= 1e-4, sorted(errs.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("name", [n for row in ROWS for n in row.decode])
def test_cached_decode_equals_recomputing(name: str) -> None:
    """Greedy tokens with the cache (latent keys and values, the indexer's keys, the linear
    layers' conv inputs and recurrent state) equal a full forward's argmax step by step, past a
    sparse model's top-k, and their logprobs its log-softmax."""
    spec = SPECS[name][1]
    engine = EngineModel.from_source(spec, source(spec))
    prompt = ids(spec)[0, :6].tolist()
    (tokens, logprobs), = engine.generate([prompt], max_new_tokens=8, temperature=0.0)
    seq = list(prompt)
    for t, lp in zip(tokens, logprobs, strict=True):
        with torch.no_grad():
            last = engine(torch.tensor([seq]))[0, -1]
        assert int(last.argmax()) == t
        assert abs(float(torch.log_softmax(last, -1)[t]) - lp) <= 1e-4
        seq.append(t)


def _world(rank: int, world: int, port: int, out) -> None:
    """Every row's trainer worlds (ranks outside a world's size wait), then its engine worlds
    (the first ``tp`` ranks) against the TP 1 engine."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results: dict[Any, Any] = {}
    refs: dict[Any, Any] = {}
    try:
        for row in ROWS:
            for case in row.trainer_cases:
                groups = megatron_groups(case.par, timeout_s=60, moe=True)
                for name in case.specs:
                    if groups.rank is not None:
                        spec = SPECS[name][1]
                        results[case.label, name] = _trainer_case(spec, case, groups, inputs(spec), refs)
            wants = {n: EngineModel.from_source(SPECS[n][1], source(SPECS[n][1]))(ids(SPECS[n][1]))
                     for n in row.worlds}
            for tp, ep in row.engine_cases:
                group = dist.new_group(list(range(tp)))
                for name in row.worlds:
                    if rank < tp:
                        spec = SPECS[name][1]
                        engine = EngineModel.from_source(spec, source(spec), rank, tp, group, ep=ep)
                        results[tp, ep, name] = rel(engine(ids(spec)), wants[name])
        out.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world() -> dict[int, dict[Any, Any]]:
    return run_world(_world, WORLD, args=(WORLD, free_port()), timeout=WORLD_TIMEOUT_S)


@pytest.mark.parametrize(("case", "name"), [(c, n) for row in ROWS for c in row.trainer_cases for n in c.specs],
                         ids=lambda x: x.label if isinstance(x, TrainerCase) else x)
def test_trainer_worlds_match_tp1(world, case: TrainerCase, name: str) -> None:
    assert_trainer_world(world, case, name, RTOL)


@pytest.mark.parametrize(("tp", "ep", "name"), [(tp, ep, n) for row in ROWS for tp, ep in row.engine_cases
                                                for n in row.worlds])
def test_engine_worlds_match_tp1(world, tp: int, ep: int, name: str) -> None:
    for r in range(tp):
        assert world[r][tp, ep, name] <= RTOL, (r, world[r][tp, ep, name])
