"""Comparisons the model tests share: relative error, and a rank's shards placed in HF tensors."""

from __future__ import annotations

import torch

from shardsync.layout import Layout
from shardsync.plan.local import region


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0/0 counts as 0)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def to_hf(layout: Layout, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Place one rank's local tensors into full HF-shaped tensors (what its pieces cover)."""
    full: dict[str, torch.Tensor] = {}
    for p in layout.ranks[rank].pieces:
        t = full.setdefault(p.logical, torch.zeros(layout.logical[p.logical]))
        t[region(p.offsets, p.sizes)] = tensors[p.local][region(p.local_offsets, p.sizes)]
    return full
