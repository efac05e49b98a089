"""The FSDP2 trainer layout: HuggingFace-named tensors, each split by rows over the shard group.

``fully_shard`` places every parameter as ``Shard(0)`` on its mesh's shard dimension with
``torch.chunk`` semantics: rank ``s`` of ``n`` holds rows ``[s*c, min((s+1)*c, rows))`` with
``c = ceil(rows / n)`` (the last ranks may hold fewer rows, or none); ``DTensor.to_local()``
is exactly that block.  HSDP (a 2-D mesh ``(replicate, shard)``) repeats the split on every
replicate group; rank order is the mesh's, shard fastest.  A tied ``lm_head`` is one tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.gcpause import gc_paused
from shardsync.layout.base import Layout
from shardsync.layout.logical import logical_tensors, model_tensors
from shardsync.piece import RankLayout, Segment, TensorMeta, stacked
from shardsync.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Fsdp2Parallel:
    """A ``fully_shard`` mesh: ``shard`` ranks split every tensor, ``replicate`` copies (HSDP)."""

    shard: int = 1
    replicate: int = 1
    dtype: str | None = None
    kind = "fsdp2"
    pp = 1  # one stage: every rank holds a slice of every layer

    @property
    def world_size(self) -> int:
        return self.shard * self.replicate

    def coords(self, rank: int) -> tuple[int, int]:
        """(replicate index, shard index) of a rank."""
        return rank // self.shard, rank % self.shard

    def rows(self, n: int, shard_rank: int) -> tuple[int, int]:
        """(first row, row count) of dim-0 length ``n`` on shard rank ``shard_rank``."""
        c = -(-n // self.shard)
        lo = min(shard_rank * c, n)
        return lo, min(c, n - lo)

    def data_rank(self, rank: int) -> tuple[int, int]:
        """Every rank trains on its own rows (FSDP2 averages the gradients over all of them)."""
        return rank, self.world_size

    def broadcast_members(self, spec: ModelSpec, stage: int) -> list[int]:
        """Replicate group 0 holds each element once; its first rank is the source."""
        return list(range(self.shard))

    def primary(self, spec: ModelSpec, rank: int) -> str:
        """Which of ``rank``'s pieces the broadcast gather reads: all on replica 0, none elsewhere."""
        return "all" if self.coords(rank)[0] == 0 else "none"

    def describe(self) -> dict[str, int]:
        return {"shard": self.shard, "replicate": self.replicate}


def check_fsdp2(spec: ModelSpec, par: Fsdp2Parallel) -> None:
    if min(par.shard, par.replicate) < 1:
        raise ValueError(f"FSDP2 layout of {spec.name} impossible: shard and replicate must be >= 1")


@gc_paused
def fsdp2_layout(spec: ModelSpec, par: Fsdp2Parallel) -> Layout:
    """Every rank's local shards (HF names, full trailing dims) of every tensor of the
    transformers model (which holds no MTP layer)."""
    return row_blocks(spec, par, model_tensors(spec), logical_tensors(spec))


def row_blocks(spec: ModelSpec, par: Fsdp2Parallel, held: dict[str, tuple[int, ...]],
               logical: dict[str, tuple[int, ...]], **params: object) -> Layout:
    """The ``held`` tensors (logical names) split by rows as ``fully_shard`` splits them."""
    check_fsdp2(spec, par)
    dtype = par.dtype or spec.dtype
    per_shard = []
    for s in range(par.shard):
        tensors, pieces = [], []
        for name, shape in held.items():
            lo, n = par.rows(shape[0], s)
            tensors.append(TensorMeta(name, (n, *shape[1:]), dtype))
            if n:
                pieces.extend(stacked(name, [Segment(name, lo, n)], logical, 0))
        per_shard.append((tuple(tensors), tuple(pieces)))
    ranks = []
    for g in range(par.world_size):
        rep, s = par.coords(g)
        ranks.append(RankLayout(f"rep{rep}.shard{s}", *per_shard[s]))
    return Layout("fsdp2", spec, logical, tuple(ranks),
                  (("shard", par.shard), ("replicate", par.replicate), *params.items()))
