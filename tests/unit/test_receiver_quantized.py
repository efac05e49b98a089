"""The FP8 destination (``receiver/quantized.py``) on one rank, no group: paths write the wide
copy, ``received`` quantizes it into the served e4m3 weights and scales (counting what changed),
``stale`` catches a served scale that is not the copy's, and what it refuses."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, engine_layout
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format, quantize, quantized
from shardsync.receiver import Params, Staged
from shardsync.receiver.quantized import Quantized

SPEC = PRESETS["tiny-qwen3-fp8"]
FMT = fp8_format("fp8")


def _live() -> tuple[dict[str, torch.Tensor], dict]:
    rank = engine_layout(SPEC, EngineParallel(tp=2, dtype="bfloat16")).ranks[0]
    targets = quantized(rank, SPEC, FMT)
    live: dict[str, torch.Tensor] = {}
    for t in rank.tensors:
        target = targets.get(t.name)
        live[t.name] = torch.zeros(t.stored, dtype=torch.float8_e4m3fn if target else torch.bfloat16)
        if target is not None:
            live[target.scale] = torch.zeros(target.scale_shape)
    return live, targets


@pytest.mark.parametrize("staged", [False, True])
def test_received_quantizes_the_copy_into_what_is_served(staged: bool) -> None:
    live, targets = _live()
    inner = Staged(live) if staged else Params(live)
    dest = Quantized(inner, targets, FMT, dtype=torch.bfloat16)
    name = "model.layers.2.mlp.down_proj.weight"
    writes = dest.tensors()
    assert writes[name].dtype == torch.bfloat16 and not any(n.endswith("_scale_inv") for n in writes)
    torch.manual_seed(0)
    for t in writes.values():
        t.copy_(torch.randn(t.shape) * 0.02)
    dest.prepare()
    changed = dest.received()
    assert changed > 0 and dest.stale() == (set(targets) if staged else set())  # staged: served until the commit
    dest.commit()
    q, s = quantize(writes[name], FMT)
    assert torch.equal(live[name].view(torch.uint8), q.view(torch.uint8)) and torch.equal(live[name + "_scale_inv"], s)
    assert dest.served()[name] is writes[name]  # checksums read what was received
    assert dest.stale() == set()
    dest.prepare()
    assert dest.received() == 0  # the same weights again: no FP8 byte changes
    live[name + "_scale_inv"].mul_(2)
    assert dest.stale() == {name}


def test_refuses_a_staging_window_and_takes_pushes_into_whole_staging() -> None:
    """A pushing trainer writes a staging set as the paths address it: e4m3 words where the plan
    carries them quantized, the model-dtype copy of the others (``received`` quantizes it)."""
    live, targets = _live()
    with pytest.raises(ValueError, match="staging window"):
        Quantized(Staged(live, budget=1024), targets, FMT, dtype=torch.bfloat16)
    assert Quantized(Params(live), targets, FMT, dtype=torch.bfloat16).unpushable() is not None  # no staging copy
    staged = Staged(live)
    q = Quantized(staged, targets, FMT, dtype=torch.bfloat16)
    assert q.unpushable() is None
    pushed = q.pushed(staged.sets()[0])
    name = next(iter(targets))
    assert pushed[name].dtype == torch.bfloat16 and targets[name].scale not in pushed  # wide until bound
