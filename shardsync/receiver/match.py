"""Whether an engine rank's live parameters are exactly shardsync's engine layout (names,
shapes, dtype): the precondition for receiving into them in place; otherwise the reason,
which a refused connect carries to the trainer."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.dtypes import torch_dtype
from shardsync.layout.piece import RankLayout

Shapes = Mapping[str, tuple[int, ...]]


def layout_difference(rank: RankLayout, shapes: Shapes, dtypes: Mapping[str, torch.dtype],
                      engine: str = "the engine") -> str | None:
    """Why ``shapes`` (name -> shape) and ``dtypes`` are not ``rank``'s engine layout, or None
    when they are (each tensor in its layout dtype: the sync's, or its family row's)."""
    mine = {t.name: tuple(t.stored) for t in rank.tensors}  # 3-D expert stacks as held
    missing, extra = sorted(set(mine) - set(shapes)), sorted(set(shapes) - set(mine))
    if missing or extra:
        return (f"parameter names differ: shardsync expects {missing[:3]} ({len(missing)} in all), "
                f"{engine} has {extra[:3]} ({len(extra)} in all) that shardsync does not")
    for t in rank.tensors:
        if shapes[t.name] != tuple(t.stored):
            return f"{t.name}: {engine} holds shape {list(shapes[t.name])}, shardsync's engine layout {list(t.stored)}"
        if dtypes[t.name] != torch_dtype(t.dtype):
            return f"{t.name}: {engine} holds {dtypes[t.name]}, shardsync's engine layout {t.dtype}"
    return None


def live_difference(rank: RankLayout, model: torch.nn.Module, engine: str = "the engine") -> str | None:
    """``layout_difference`` of ``model``'s live parameters; also refuses parameters that are
    not plain contiguous tensors (an in-place receive writes through views of them)."""
    live = dict(model.named_parameters())  # deduplicated: a tied lm_head is not listed
    why = layout_difference(rank, {n: tuple(p.shape) for n, p in live.items()}, {n: p.dtype for n, p in live.items()},
                            engine)
    if why is None:
        odd = next((n for n, p in live.items() if type(p.data) is not torch.Tensor or not p.is_contiguous()), None)
        if odd is not None:
            why = f"{odd}: {engine} holds a {type(live[odd].data).__name__} that is not a plain contiguous tensor"
    return why
