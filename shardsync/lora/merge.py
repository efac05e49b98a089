"""The low-rank merge as metadata: where ``scale * B @ A`` of each adapted linear lands in an
engine rank's own base tensors (fused QKV and gate/up rows included), read off the pieces of
its base layout and its adapter layout.  An engine without a LoRA kernel serves these merged
weights and receives only ``A`` and ``B`` (``receiver/merged.py`` does the arithmetic)."""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.lora.config import Lora
from shardsync.lora.layout import adapter_pairs
from shardsync.lora.table import TARGETS
from shardsync.piece import Box, RankLayout, box_overlap
from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class MergeStep:
    """``base[region] = kept + scale * B[b_rows] @ A[:, a_cols]``: ``region`` (offsets, sizes) of
    the local base tensor ``base``; ``b_rows`` / ``a_cols`` (start, length) of the local adapter
    tensors ``b`` and ``a``."""

    base: str
    offsets: Box
    sizes: Box
    a: str
    a_cols: tuple[int, int]
    b: str
    b_rows: tuple[int, int]


def merge_plan(spec: ModelSpec, base: RankLayout, adapter: RankLayout, lora: Lora) -> tuple[MergeStep, ...]:
    """Every step of one rank's merge, for each target of each layer this rank holds: the
    logical box its ``B`` rows x ``A`` columns cover, met with the base pieces of that weight
    (the pairs: ``lora.layout.adapter_pairs``)."""
    held = {p.logical: p for p in adapter.pieces}
    by_weight: dict[str, list] = {}
    for p in base.pieces:
        by_weight.setdefault(p.logical, []).append(p)
    steps = []
    pairs = [(held[pair.a], held[pair.b], pair.weight) for pair in adapter_pairs(spec, lora) if pair.a in held]
    for a, b, weight in pairs:
        # the logical box of the weight this rank's term covers: B's rows x A's columns
        box_off, box_size = (b.offsets[0], a.offsets[1]), (b.sizes[0], a.sizes[1])
        for p in by_weight.get(weight, []):
            hit = box_overlap(box_off, box_size, p.offsets, p.sizes)
            if hit is None:
                continue
            (r0, c0), (nr, nc) = hit
            local = (p.local_offsets[0] + r0 - p.offsets[0], p.local_offsets[1] + c0 - p.offsets[1])
            steps.append(MergeStep(p.local, local, (nr, nc),
                                   a.local, (a.local_offsets[1] + c0 - a.offsets[1], nc),
                                   b.local, (b.local_offsets[0] + r0 - b.offsets[0], nr)))
    covered = {s.a for s in steps}
    missing = [a.local for a, _, _ in pairs if a.local not in covered]
    if missing:
        modules = ", ".join(TARGETS[t].module for t in lora.targets)
        raise ValueError(f"{base.label}: no base weight to merge {missing[:3]} into; a merging engine needs the "
                         f"adapted linears of the layers it holds ({modules})")
    return tuple(steps)
