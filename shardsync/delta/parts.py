"""Parts: the unit a delta is diffed, encoded and applied in (pure metadata + tensor ops).

A part is one copy of a plan seen from its owner: a box of a logical tensor that one
trainer rank holds in one local tensor.  p2p parts are the p2p plan's copies (one
receiver each); broadcast and disk parts are the gather plan's copies of a stage (every
engine rank keeps the intersection with its own pieces).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shardsync.dtypes import torch_dtype
from shardsync.piece import Box, RankLayout, box_overlap
from shardsync.plan.plan import Copy, Plan


@dataclass(frozen=True, slots=True)
class Part:
    """``raw``: the dtype the part's values move in when it is not the wire's (``layout/raw.py``)."""

    owner: int
    local: str
    local_offsets: Box
    logical: str
    offsets: Box
    sizes: Box
    raw: str | None = None

    @staticmethod
    def of(c: Copy, raw: Mapping[str, str]) -> Part:
        return Part(c.src, c.src_local, c.src_offsets, c.logical, c.logical_offsets, c.sizes, raw.get(c.logical))

    def dtype(self, wire: torch.dtype) -> torch.dtype:
        """What its values are diffed, encoded and applied in."""
        return wire if self.raw is None else torch_dtype(self.raw)

    def region(self) -> tuple[slice, ...]:
        return tuple(slice(o, o + s) for o, s in zip(self.local_offsets, self.sizes, strict=True))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n


def p2p_parts(plan: Plan, src: int, dst: int) -> list[Part]:
    """The parts of one link, in plan order."""
    return [Part.of(c, plan.raw) for c in plan.copies_on(src, dst)]


def stage_parts(gather: Plan, stage_ranks: list[int]) -> list[Part]:
    """A stage's parts: owners in rank order, each owner's parts in plan order."""
    by_owner: dict[int, list[Part]] = {r: [] for r in stage_ranks}
    for c in gather.copies:
        if c.src in by_owner:
            by_owner[c.src].append(Part.of(c, gather.raw))
    return [p for r in stage_ranks for p in by_owner[r]]


Target = tuple[str, tuple[slice, ...], tuple[slice, ...]]  # (local name, local region, part sub-box)


def targets_for(part: Part, rank: RankLayout) -> list[Target]:
    """Where the elements of ``part`` live on a rank: (local tensor, its region, part sub-box)."""
    out = []
    for p in rank.pieces:
        if p.logical != part.logical:
            continue
        ov = box_overlap(p.offsets, p.sizes, part.offsets, part.sizes)
        if ov is None:
            continue
        off, size = ov
        local = tuple(slice(lo + o - po, lo + o - po + s)
                      for lo, o, po, s in zip(p.local_offsets, off, p.offsets, size, strict=True))
        sub = tuple(slice(o - qo, o - qo + s) for o, qo, s in zip(off, part.offsets, size, strict=True))
        out.append((p.local, local, sub))
    return out


def _inside(idx: list[torch.Tensor], sub: tuple[slice, ...]) -> torch.Tensor:
    mask = torch.ones_like(idx[0], dtype=torch.bool)
    for i, s in zip(idx, sub, strict=True):
        mask &= (i >= s.start) & (i < s.stop)
    return mask


def _covers(sub: tuple[slice, ...], sizes: Box) -> bool:
    return all(s.start == 0 and s.stop == n for s, n in zip(sub, sizes, strict=True))


def apply_values(part: Part, positions: torch.Tensor | None, values: torch.Tensor,
                 tensors: Mapping[str, torch.Tensor], targets: list[Target]) -> int:
    """Write a part's new values into every target; returns elements written.

    Sparse values land by flat index (``index_put_`` on a flat view): positions are mapped
    through the target's strides once, with no per-element masks when a target holds the
    whole part (every p2p part).
    """
    written = 0
    if positions is None:
        box = values.view(part.sizes)
        for name, region, sub in targets:
            tensors[name][region].copy_(box[sub])
            written += box[sub].numel()
        return written
    idx = None
    for name, region, sub in targets:
        t = tensors[name]
        if not t.is_contiguous():
            raise ValueError(f"{name}: delta targets must be contiguous tensors")
        if _covers(sub, part.sizes):
            pos, vals, shift = positions, values, [r.start for r in region]
            coords = _unravel(pos, part.sizes)
        else:
            idx = idx if idx is not None else _unravel(positions, part.sizes)
            m = _inside(idx, sub)
            if not bool(m.any()):
                continue
            coords = [i[m] for i in idx]
            vals = values[m]
            shift = [r.start - s.start for r, s in zip(region, sub, strict=True)]
        flat = torch.zeros_like(coords[0])
        for c, off, stride in zip(coords, shift, t.stride(), strict=True):
            flat += (c + off) * stride
        t.view(-1).index_copy_(0, flat, vals.to(t.dtype))
        written += flat.numel()
    return written


def _unravel(positions: torch.Tensor, sizes: Box) -> list[torch.Tensor]:
    if len(sizes) == 1:
        return [positions]
    if len(sizes) == 2:
        return [positions // sizes[1], positions % sizes[1]]
    return list(torch.unravel_index(positions, sizes))


def apply_xor(part: Part, mask_bits: torch.Tensor, tensors: Mapping[str, torch.Tensor],
              targets: list[Target], wire: torch.dtype) -> None:
    """XOR a part's dense bit mask into every target (exactly once, on the right base).  The
    mask is in the bits of the part's dtype (``Part.dtype``); a target held wider than that
    (an engine's float32 router weight under a bfloat16 sync) is XORed in it and widened back,
    exactly."""
    from shardsync.delta.encode import _INT

    dtype = part.dtype(wire)
    box = mask_bits.view(part.sizes)
    for name, region, sub in targets:
        t = tensors[name]
        view = t[region]
        mixed = view.to(dtype).contiguous().view(_INT[box.element_size()]) ^ box[sub]
        view.copy_(mixed.view(dtype))
