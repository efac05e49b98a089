"""The gated DeltaNet math (``models/deltanet.py``) against transformers' own layers: Qwen3-Next's
``Qwen3NextGatedDeltaNet`` and Qwen3.5's ``Qwen3_5MoeGatedDeltaNet`` on the same weights (fp32,
relative <= 1e-5; transformers runs its chunked form, ours steps), from every engine TP rank's
tensors summed (whole key-head groups), and a prefill then one-token steps with the carried conv
and recurrent state against the full sequence."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.deltanet import DeltaWeights, deltanet
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS

CASES = {"tiny-qwen3-next": True, "tiny-qwen3.5-moe": False}  # interleaved checkpoint projections
L = "model.layers.0.linear_attn."


def _hf_layer(spec, source):
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    layer = model.model.layers[0].linear_attn.eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(source(L + name).view_as(p))
    return layer


def _source(spec):
    base = random_source(spec, seed=4)

    def get(name: str) -> torch.Tensor:  # A_log near the real ones (decays of 0.9-1 per token)
        return base(name) * 50 - 2.5 if name.endswith("A_log") else base(name)
    return get


def _weights(spec, tp: int, rank: int, source) -> DeltaWeights:
    lay = engine_layout(spec, EngineParallel(tp=tp))
    t = load_rank(lay, rank, source)
    return DeltaWeights(*(t[L + n] for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "dt_bias",
                                             "A_log", "norm.weight", "out_proj.weight")))


def _x(spec, s: int = 13) -> torch.Tensor:
    return torch.randn(2, s, spec.hidden_size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_ranks_sum_to_transformers(name: str, tp: int) -> None:
    spec = PRESETS[name]
    source = _source(spec)
    assert set(logical_tensors(spec)) >= {L + "A_log"}
    x = _x(spec)
    with torch.no_grad():
        want = _hf_layer(spec, source)(x)
    got = sum(deltanet(spec, x, _weights(spec, tp, r, source), interleaved=CASES[name])[0] for r in range(tp))
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


@pytest.mark.parametrize("name", CASES)
def test_steps_with_the_carried_state_equal_the_whole_sequence(name: str) -> None:
    spec = PRESETS[name]
    w = _weights(spec, 2, 1, _source(spec))
    x = _x(spec)
    whole, _ = deltanet(spec, x, w, interleaved=CASES[name])
    out, state = deltanet(spec, x[:, :6], w, interleaved=CASES[name])
    parts = [out]
    for t in range(6, x.shape[1]):
        out, state = deltanet(spec, x[:, t:t + 1], w, interleaved=CASES[name], state=state)
        parts.append(out)
    assert torch.allclose(torch.cat(parts, dim=1), whole, rtol=1e-5, atol=1e-6)
