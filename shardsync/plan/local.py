"""Execute a plan inside one process: checkpoint loading and the reference for transports."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping, Sequence

import torch

from shardsync.dtypes import torch_dtype
from shardsync.plan.plan import Copy, Plan


def region(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def allocate(plan: Plan, rank: int, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Zeroed destination tensors of ``rank`` (padding stays zero)."""
    return {
        t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device)
        for t in plan.dst.ranks[rank].tensors
    }


def apply_copy(c: Copy, src: Mapping[str, torch.Tensor], dst: MutableMapping[str, torch.Tensor]) -> None:
    dst[c.dst_local][region(c.dst_offsets, c.sizes)].copy_(src[c.src_local][region(c.src_offsets, c.sizes)])


def execute_local(
    plan: Plan,
    sources: Sequence[Mapping[str, torch.Tensor]],
    destinations: Sequence[MutableMapping[str, torch.Tensor]] | None = None,
) -> list[MutableMapping[str, torch.Tensor]]:
    """Run every copy of ``plan`` in memory; ``sources[r]`` are src rank r's local tensors."""
    if len(sources) != plan.src.world_size:
        raise ValueError(f"plan has {plan.src.world_size} source ranks, got {len(sources)} tensor maps")
    if destinations is None:
        destinations = [allocate(plan, r) for r in range(plan.dst.world_size)]
    for c in plan.copies:
        apply_copy(c, sources[c.src], destinations[c.dst])
    return list(destinations)
