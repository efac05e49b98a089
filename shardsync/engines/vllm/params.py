"""Which destination a vLLM rank can take, from its real parameters.

vLLM keeps the at-load shape of every parameter it repacks after loading (its layerwise
reload metadata: on CPU, linear weights become oneDNN handles and the live parameter has
shape ``[0]``).  When every live parameter is exactly shardsync's engine-layout tensor, the
receive writes into it in place (``params``); when only the at-load shapes match, received
slices go through vLLM's own loader (``loader``); otherwise the layouts differ and the
reason is returned.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.layout.piece import RankLayout

Shapes = Mapping[str, tuple[int, ...]]


def at_load_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Each parameter's shape as vLLM loaded it (before any repacking)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    out = {}
    modules = dict(model.named_modules())
    for name, p in model.named_parameters():  # deduplicated: a tied lm_head is not listed
        mod_name, _, leaf = name.rpartition(".")
        info = LAYERWISE_INFO.get(modules.get(mod_name))
        meta = info.restore_metadata[0].get(leaf) if info is not None and info.restore_metadata else None
        out[name] = tuple(meta.shape) if meta is not None else tuple(p.shape)
    return out


def layout_difference(rank: RankLayout, shapes: Shapes, dtypes: Mapping[str, torch.dtype],
                      dtype: torch.dtype) -> str | None:
    """Why ``shapes`` (name -> shape) is not ``rank``'s engine layout, or None when it is."""
    mine = {t.name: tuple(t.shape) for t in rank.tensors}
    missing, extra = sorted(set(mine) - set(shapes)), sorted(set(shapes) - set(mine))
    if missing or extra:
        return (f"parameter names differ: shardsync expects {missing[:3]} ({len(missing)} in all), "
                f"vLLM has {extra[:3]} ({len(extra)} in all) that shardsync does not")
    for name, shape in mine.items():
        if shapes[name] != shape:
            return f"{name}: vLLM holds shape {list(shapes[name])}, shardsync's engine layout {list(shape)}"
        if dtypes[name] != dtype:
            return f"{name}: vLLM holds {dtypes[name]}, the sync runs {dtype}"
    return None


def choose(rank: RankLayout, model: torch.nn.Module, dtype: torch.dtype) -> tuple[str, str | None]:
    """(``params`` | ``loader``, None) or (``loader``, the reason the layouts differ)."""
    live = dict(model.named_parameters())
    dtypes = {n: p.dtype for n, p in live.items()}
    if layout_difference(rank, {n: tuple(p.shape) for n, p in live.items()}, dtypes, dtype) is None \
            and all(type(p.data) is torch.Tensor and p.is_contiguous() for p in live.values()):
        return "params", None
    return "loader", layout_difference(rank, at_load_shapes(model), dtypes, dtype)
