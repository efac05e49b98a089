"""The layout vocabulary: which boxes of which logical tensors each rank's local tensors hold.

A ``Piece`` says "box ``offsets/sizes`` of logical tensor L lives at ``local_offsets`` of
local tensor T".  Elements of a local tensor that no piece covers are padding (vocab
padding rows): loaders zero them and syncs never write them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

Box = tuple[int, ...]


def volume(sizes: Box) -> int:
    """Number of elements of a box (or a shape)."""
    n = 1
    for s in sizes:
        n *= s
    return n


@dataclass(frozen=True, slots=True)
class Piece:
    logical: str
    offsets: Box
    sizes: Box
    local: str
    local_offsets: Box

    @property
    def numel(self) -> int:
        return volume(self.sizes)


class Role(Enum):
    """What a local tensor's elements are, set by the view that retyped its layout: the model's
    values, a weight's quantized words or their scales, or the twin that receives one box of a
    quantized tensor in the model dtype.  Read as a field; a name is never parsed for it."""

    VALUES = "values"
    WORDS = "words"
    SCALES = "scales"
    TWIN = "twin"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """A local tensor.  Pieces address ``shape``; ``held`` is the shape the owner keeps when that
    differs (an engine's 3-D expert stack ``[E_loc, rows, cols]`` is addressed as the 2-D
    ``[E_loc * rows, cols]`` view, so every plan, run and pack stays two-dimensional).

    ``role`` and ``parent`` say what the tensor is and what it belongs to (the words a scale
    tensor scales, the tensor a twin stands in for); ``at`` is a twin's box offsets in its
    parent (its sizes are ``shape``)."""

    name: str
    shape: Box
    dtype: str
    held: Box | None = None
    fp8: bool = False  # an FP8 engine holds it in e4m3 with block scales (its row's ``Row.fp8``)
    role: Role = Role.VALUES
    parent: str | None = None
    at: Box | None = None

    @property
    def numel(self) -> int:
        return volume(self.shape)

    @property
    def stored(self) -> Box:
        return self.held or self.shape


def addressed(tensor, meta: TensorMeta):
    """``tensor`` (held by its owner as ``meta.stored``) as the view pieces address."""
    if meta.held is None or tuple(tensor.shape) != meta.held:
        return tensor
    return tensor.view(meta.shape)


@dataclass(frozen=True)
class RankLayout:
    """What one process holds: its local tensors (in parameter order) and their pieces."""

    label: str
    tensors: tuple[TensorMeta, ...]
    pieces: tuple[Piece, ...]
    _by_name: dict[str, TensorMeta] = field(default_factory=dict, compare=False, repr=False)

    def tensor(self, name: str) -> TensorMeta:
        if not self._by_name:  # made when first asked: a broadcast's 256 replicas of 70 k tensors never are
            self._by_name.update({t.name: t for t in self.tensors})
        return self._by_name[name]

    def pieces_of(self, local: str) -> list[Piece]:
        return [p for p in self.pieces if p.local == local]


def box_overlap(a_off: Box, a_size: Box, b_off: Box, b_size: Box) -> tuple[Box, Box] | None:
    """Intersection of two boxes as (offsets, sizes), or None when empty."""
    offs, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size, strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


@dataclass(frozen=True, slots=True)
class Segment:
    """Rows ``[start, start+length)`` along ``dim`` of a logical tensor, all of the other dims."""

    logical: str
    start: int
    length: int


def stacked(
    local: str,
    segments: Sequence[Segment],
    logical: dict[str, Box],
    dim: int,
    window: tuple[int, int] | None = None,
) -> list[Piece]:
    """Pieces of a local tensor that is ``window`` of the concatenation of ``segments``.

    Fused tensors (QKV, gate/up) and TP shards of them are both this: a run of logical
    row ranges stacked along ``dim`` (counted from 0), of which a rank keeps one contiguous window.
    """
    lo, hi = window if window is not None else (0, sum(s.length for s in segments))
    # Layouts call this per fused tensor of every rank (10^5 segments for a 1T model): the box
    # tuples are built by slicing, without a list per box or a call per bound.
    pieces, pos = [], 0
    for seg in segments:
        end = pos + seg.length
        a = lo if lo > pos else pos
        b = hi if hi < end else end
        if a < b:
            shape = logical[seg.logical]
            zeros = (0,) * len(shape)
            pieces.append(Piece(seg.logical, zeros[:dim] + (seg.start + a - pos,) + zeros[dim + 1:],
                                shape[:dim] + (b - a,) + shape[dim + 1:], local,
                                zeros[:dim] + (a - lo,) + zeros[dim + 1:]))
        pos = end
    return pieces


def whole(local: str, logical_name: str, logical: dict[str, Box]) -> Piece:
    shape = logical[logical_name]
    zeros = (0,) * len(shape)
    return Piece(logical_name, zeros, shape, local, zeros)
