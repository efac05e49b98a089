"""Whether an engine rank's live parameters are exactly shardsync's engine layout (names,
shapes, dtype): the precondition for receiving into them in place; otherwise the reason,
which a refused connect carries to the trainer."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.dtypes import torch_dtype
from shardsync.piece import RankLayout
from shardsync.quant.targets import Target

Shapes = Mapping[str, tuple[int, ...]]


def served_layout(rank: RankLayout, targets: Mapping[str, Target]) -> tuple[dict[str, tuple[int, ...]],
                                                                             dict[str, torch.dtype]]:
    """The shapes and dtypes an engine rank holds: each tensor as its layout says (3-D expert
    stacks as held, the sync's dtype or its family row's); an FP8 engine's ``targets`` in
    e4m3 beside their float32 scales."""
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, torch.dtype] = {}
    for t in rank.tensors:
        target = targets.get(t.name)
        if target is None:
            shapes[t.name], dtypes[t.name] = tuple(t.stored), torch_dtype(t.dtype)
        else:
            shapes[t.name], dtypes[t.name] = target.shape, torch.float8_e4m3fn
            shapes[target.scale], dtypes[target.scale] = target.scale_shape, torch.float32
    return shapes, dtypes


def layout_difference(rank: RankLayout, shapes: Shapes, dtypes: Mapping[str, torch.dtype],
                      engine: str = "the engine", targets: Mapping[str, Target] | None = None) -> str | None:
    """Why ``shapes`` (name -> shape) and ``dtypes`` are not ``rank``'s engine layout (an FP8
    engine's with ``targets``), or None when they are."""
    mine, my_dtypes = served_layout(rank, targets or {})
    missing, extra = sorted(set(mine) - set(shapes)), sorted(set(shapes) - set(mine))
    if missing or extra:
        return (f"parameter names differ: shardsync expects {missing[:3]} ({len(missing)} in all), "
                f"{engine} has {extra[:3]} ({len(extra)} in all) that shardsync does not")
    for name, shape in mine.items():
        if shapes[name] != shape:
            return f"{name}: {engine} holds shape {list(shapes[name])}, shardsync's engine layout {list(shape)}"
        if dtypes[name] != my_dtypes[name]:
            return f"{name}: {engine} holds {dtypes[name]}, shardsync's engine layout {dtype_word(my_dtypes[name])}"
    return None


def dtype_word(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def live_difference(rank: RankLayout, model: torch.nn.Module, engine: str = "the engine", *,
                    targets: Mapping[str, Target] | None = None, skip: tuple[str, ...] = ()) -> str | None:
    """``layout_difference`` of ``model``'s live parameters (names ending in ``skip`` are not
    weights); also refuses parameters that are not plain contiguous tensors (an in-place
    receive writes through views of them)."""
    live = {n: p for n, p in model.named_parameters() if not (skip and n.endswith(skip))}  # a tied lm_head: once
    why = layout_difference(rank, {n: tuple(p.shape) for n, p in live.items()}, {n: p.dtype for n, p in live.items()},
                            engine, targets)
    if why is None:
        odd = next((n for n, p in live.items() if type(p.data) is not torch.Tensor or not p.is_contiguous()), None)
        if odd is not None:
            why = f"{odd}: {engine} holds a {type(live[odd].data).__name__} that is not a plain contiguous tensor"
    return why
