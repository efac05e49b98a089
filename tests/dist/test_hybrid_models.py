"""What only the gated DeltaNet hybrids have: zero-centred norms.  Their models against
transformers, decode and parallel worlds run in the family suite (``test_family_models.py``,
row ``hybrid``)."""

from __future__ import annotations

import torch

from shardsync.models.engine import EngineModel
from shardsync.presets import PRESETS
from tests.dist.test_family_models import ids, source


def test_norms_are_zero_centred() -> None:
    """Zeroed norm weights scale by one (``1 + w``): the model still computes; the reference rows'
    zero init would give all-zero logits if a norm multiplied by ``w``."""
    spec = PRESETS["tiny-qwen3-next"]
    src = source(spec)
    engine = EngineModel.from_source(spec, lambda n: torch.zeros_like(src(n)) if "norm" in n and "linear_attn" not in n
                                     else src(n))
    assert engine(ids(spec)).abs().max() > 0
