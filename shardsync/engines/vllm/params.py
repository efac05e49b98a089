"""Which destination a vLLM rank can take, from its real parameters.

vLLM keeps the at-load shape of every parameter it repacks after loading (its layerwise
reload metadata: on CPU, linear weights become oneDNN handles and the live parameter has
shape ``[0]``).  When every live parameter is exactly shardsync's engine-layout tensor, the
receive writes into it in place (``params``); when only the at-load shapes match, received
slices go through vLLM's own loader (``loader``); otherwise the layouts differ and the
reason is returned.
"""

from __future__ import annotations

import torch

from shardsync.piece import RankLayout
from shardsync.receiver.match import layout_difference, live_difference


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


def choose(rank: RankLayout, model: torch.nn.Module) -> tuple[str, str | None]:
    """(``params`` | ``loader``, None) or (``loader``, the reason the layouts differ)."""
    if live_difference(rank, model, "vLLM") is None:
        return "params", None
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    return "loader", layout_difference(rank, at_load_shapes(model), dtypes, "vLLM")
