"""A layout: one model's tensors over a set of ranks, each rank's local tensors as pieces of
the logical ones (``shardsync.piece``); every layout builder returns one."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from shardsync.piece import Box, Piece, RankLayout, box_overlap
from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class Layout:
    """A layout of one model over a set of ranks (``kind`` names the convention)."""

    kind: str
    spec: ModelSpec
    logical: dict[str, Box]
    ranks: tuple[RankLayout, ...]
    params: tuple[tuple[str, object], ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.kind}({args})"

    def validate(self) -> None:
        """Refuse pieces outside their tensors or overlapping inside a local tensor."""
        for rank in self.ranks:
            seen: dict[str, list[Piece]] = {}
            for p in rank.pieces:
                if p.logical not in self.logical:
                    raise ValueError(f"{rank.label}: piece of unknown logical tensor {p.logical}")
                lshape = self.logical[p.logical]
                meta = rank.tensor(p.local)
                if len(p.sizes) != len(lshape) or len(meta.shape) != len(lshape):
                    raise ValueError(f"{rank.label}: rank mismatch in {p}")
                for o, s, n in zip(p.offsets, p.sizes, lshape, strict=True):
                    if o < 0 or o + s > n:
                        raise ValueError(f"{rank.label}: {p} exceeds logical shape {lshape}")
                for o, s, n in zip(p.local_offsets, p.sizes, meta.shape, strict=True):
                    if o < 0 or o + s > n:
                        raise ValueError(f"{rank.label}: {p} exceeds local shape {meta.shape}")
                for q in seen.setdefault(p.local, []):
                    if box_overlap(p.local_offsets, p.sizes, q.local_offsets, q.sizes):
                        raise ValueError(f"{rank.label}: pieces overlap in {p.local}: {p} / {q}")
                seen[p.local].append(p)


def concat_layouts(kind: str, layouts: Iterable[Layout]) -> Layout:
    """Several layouts of one model as one (e.g. N engines as one destination)."""
    layouts = list(layouts)
    if not layouts:
        raise ValueError("concat_layouts needs at least one layout")
    spec = layouts[0].spec
    ranks: list[RankLayout] = []
    for i, lay in enumerate(layouts):
        if lay.spec != spec:
            raise ValueError("cannot combine layouts of different models")
        for r in lay.ranks:
            ranks.append(RankLayout(f"{kind}{i}.{r.label}", r.tensors, r.pieces))
    params = tuple((f"{kind}{i}", lay.describe()) for i, lay in enumerate(layouts))
    return Layout(kind, spec, layouts[0].logical, tuple(ranks), params)
