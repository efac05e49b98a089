"""The trainer side of the weight views (``shardsync.views``): what derives a rank's wire
tensors from its parameters before each send.  An FP8 engine's words and scales are quantized
here (``runtime.quantizer.SourceQuantizer``, also the push path's producer).  Execution lives in
the runtime room, above the views', so the sides are a table from a bound view's type, as
``receiver.viewed`` is the engine side's."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardsync.quant.wire import Derived
from shardsync.runtime.quantizer import SourceQuantizer
from shardsync.topology import Topology
from shardsync.views import BoundView, Fp8Bound

Make = Callable[[Any, Sequence[Derived], Mapping[str, torch.Tensor], bool], SourceQuantizer]


def _fp8(bound: Fp8Bound, derived: Sequence[Derived], params: Mapping[str, torch.Tensor],
         count: bool) -> SourceQuantizer:
    return SourceQuantizer(derived, params, bound.wire.fmt, count=count)


DERIVERS: dict[type[BoundView], Make] = {Fp8Bound: _fp8}


def deriver(topo: Topology, rank: int, params: Mapping[str, torch.Tensor], *,
            count: bool) -> SourceQuantizer | None:
    """What derives trainer ``rank``'s share of ``topo``'s derived tensors from ``params``
    (``count``: also count what changed); None where the views derive nothing here."""
    derived = topo.derived(rank)
    made = (make(w, derived, params, count) for w in topo.bound.wires if (make := DERIVERS.get(type(w))) and derived)
    return next(made, None)
