"""Rows of a family's tables read as pieces: the kinds every layout shares (``Whole``,
``Split``, ``Fused``) here; a layout passes its own kinds (fused QKV, experts) as ``own``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from shardsync.family.table import Concat, Fused, Part, Row, Rows, Split, Whole, dims
from shardsync.layout.piece import Box, Piece, Segment, TensorMeta, stacked, whole
from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class Local:
    """One local tensor a row cut: pieces address ``shape``; ``held`` is the owner's shape
    where that differs (engine expert stacks)."""

    name: str
    shape: Box
    pieces: list[Piece]
    held: Box | None = None
    fp8: bool = False  # its row's ``fp8``

    def meta(self, dtype: str) -> TensorMeta:
        return TensorMeta(self.name, self.shape, dtype, self.held if self.held != self.shape else None, fp8=self.fp8)


@dataclass(frozen=True)
class Cut:
    """Where one rank sits when it cuts a layer: the layer's local and HF name prefixes, the
    tensor-parallel split dense rows follow, and the fields row names are formatted with."""

    spec: ModelSpec
    layer: int
    local: str  # the local names' prefix (Megatron: ``decoder.layers.{local}.``)
    tp: int
    rank: int
    logical: dict[str, Box]
    names: dict[str, str] = field(default_factory=dict)
    variants: frozenset[str] = frozenset()  # the layout's variant words (``Row.exists``)
    hf_prefix: str = ""  # the logical names' prefix when not ``model.layers.{layer}.`` (MTP layers)

    @property
    def hf(self) -> str:
        return self.hf_prefix or f"model.layers.{self.layer}."

    def part(self, part: Part | Rows) -> list[Segment]:
        """This rank's slice of ``part``: its share of the part's rows, or of its groups."""
        name = self.hf + part.name
        if isinstance(part, Part):
            rows = self.logical[name][0] // part.count
            n = rows // self.tp
            return [Segment(name, part.index * rows + self.rank * n, n)]
        sym = dims(self.spec)

        def num(s: str) -> int:
            return int(s) if s.isdigit() else sym[s]

        start, size = num(part.start), num(part.size)
        if part.groups is None:
            n = size // self.tp
            return [Segment(name, start + self.rank * n, n)]
        groups, stride = num(part.groups), num(part.stride or part.size)
        mine = groups // self.tp
        return [Segment(name, start + g * stride, size) for g in range(self.rank * mine, (self.rank + 1) * mine)]


Own = Callable[[Row, str, Cut], list[Local]]


def cut_rows(rows: Iterable[Row], c: Cut, own: Own) -> list[tuple[Local, str | None]]:
    """Every row that exists for the spec as (local tensor, its dtype when not the model's)."""
    out: list[tuple[Local, str | None]] = []
    for row in rows:
        if not row.exists(c.spec, c.variants):
            continue
        name = c.local + row.name.format(**c.names)
        kind = row.kind
        if isinstance(kind, Whole):
            src = c.hf + (kind.source or row.name)
            made = [Local(name, c.logical[src], [whole(name, src, c.logical)])]
        elif isinstance(kind, Split):
            src = c.hf + (kind.source or row.name)
            shape = list(c.logical[src])
            n = shape[kind.dim] // c.tp
            shape[kind.dim] = n
            made = [Local(name, tuple(shape), stacked(name, [Segment(src, c.rank * n, n)], c.logical, kind.dim))]
        elif isinstance(kind, Concat):
            srcs = [c.hf + s for s in kind.sources]
            segs = [Segment(s, 0, c.logical[s][0]) for s in srcs]
            cols = c.logical[srcs[0]][1:]
            made = [Local(name, (sum(s.length for s in segs), *cols), stacked(name, segs, c.logical, 0))]
        elif isinstance(kind, Fused):
            segs = [seg for p in kind.parts for seg in c.part(p)]
            cols = c.logical[segs[0].logical][1:]
            made = [Local(name, (sum(s.length for s in segs), *cols), stacked(name, segs, c.logical, 0))]
        else:
            made = own(row, name, c)
        out += [(replace(m, fp8=True) if row.fp8 else m, row.dtype) for m in made]
    return out
