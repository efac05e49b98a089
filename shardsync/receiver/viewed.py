"""The engine side of the weight views (``shardsync.views``): the destination each view wraps
around the one its host built.  An FP8 engine quantizes what arrives wide into what it serves
(``Quantized``).  Destinations live in this room, above the views' own, so the sides are a
table from a view's type to its wrapper; a view without a row leaves the destination as it is
(an adapter: each host receives it its own way, merged, in a LoRA kernel's tensors or a PEFT
directory)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shardsync.piece import RankLayout
from shardsync.quant import quantized
from shardsync.receiver.destination import Destination
from shardsync.receiver.quantized import Quantized
from shardsync.spec import ModelSpec
from shardsync.views import Fp8View, Views, WeightView


@dataclass(frozen=True)
class EngineRank:
    """What a view's engine side wraps for: the rank's model, its layout and where it computes."""

    spec: ModelSpec
    rank: RankLayout
    dtype: torch.dtype
    device: torch.device | str = "cpu"


@dataclass(frozen=True)
class Side:
    """A view's engine side: its wrapper, and whether it needs shards in place (a loader's whole
    tensors cannot reach it)."""

    wrap: Callable[[Any, Destination, EngineRank], Destination]
    in_place_only: bool = False


def _fp8(view: Fp8View, inner: Destination, at: EngineRank) -> Destination:
    return Quantized(inner, quantized(at.rank, at.spec, view.fmt), view.fmt, dtype=at.dtype, device=at.device)


SIDES: dict[type[WeightView], Side] = {Fp8View: Side(_fp8, in_place_only=True)}


def wrap(views: Views, inner: Destination, at: EngineRank) -> Destination:
    """``inner`` wrapped by each view's engine side, in the views' order."""
    for v in views.views:
        side = SIDES.get(type(v))
        inner = inner if side is None else side.wrap(v, inner, at)
    return inner


def loader_refusal(views: Views) -> str | None:
    """Why an engine serving ``views`` cannot take whole tensors through its loader (None: it can)."""
    return next((f"an engine serving {v.quantization() or v} receives shards in place only (into its parameters)"
                 for v in views.views if (side := SIDES.get(type(v))) is not None and side.in_place_only), None)
