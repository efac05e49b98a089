"""The engine layout check (``receiver.match``) without an engine: shardsync's engine layout
against parameter tables shaped like vLLM's (live, repacked to ``[0]``, or different)."""

from __future__ import annotations

import torch

from shardsync.layout import EngineParallel, engine_layout
from shardsync.presets import PRESETS
from shardsync.receiver.match import layout_difference


def _rank(tp: int = 2, r: int = 1):
    return engine_layout(PRESETS["tiny-qwen3"], EngineParallel(tp=tp, dtype="float32")).ranks[r]


def _table(rank):
    return ({t.name: tuple(t.shape) for t in rank.tensors}, {t.name: torch.float32 for t in rank.tensors})


def test_same_layout_has_no_difference() -> None:
    rank = _rank()
    shapes, dtypes = _table(rank)
    assert layout_difference(rank, shapes, dtypes) is None


def test_repacked_parameter_is_a_difference_naming_it() -> None:
    rank = _rank()
    shapes, dtypes = _table(rank)
    shapes["model.layers.0.self_attn.qkv_proj.weight"] = (0,)
    why = layout_difference(rank, shapes, dtypes)
    assert why is not None and "qkv_proj" in why and "[0]" in why


def test_other_tp_or_padding_is_a_difference() -> None:
    rank = _rank(tp=2)
    other = _rank(tp=1, r=0)
    shapes, dtypes = _table(other)
    why = layout_difference(rank, shapes, dtypes)
    assert why is not None and "shape" in why


def test_missing_and_extra_names_and_dtype() -> None:
    rank = _rank()
    shapes, dtypes = _table(rank)
    shapes["lm_head.weight"] = (576, 256)
    dtypes["lm_head.weight"] = torch.float32
    assert "names differ" in layout_difference(rank, shapes, dtypes)
    shapes, dtypes = _table(rank)
    dtypes["model.norm.weight"] = torch.bfloat16
    assert "bfloat16" in layout_difference(rank, shapes, dtypes)
