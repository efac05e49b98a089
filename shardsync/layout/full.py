"""Full-tensor layouts: holders of whole logical tensors under their HF names.

Used by the broadcast path (one source per pipeline stage, every engine rank a receiver
of whole tensors) and by checkpoints on disk.
"""

from __future__ import annotations

from collections.abc import Sequence

from shardsync.gcpause import gc_paused
from shardsync.layout.base import Layout
from shardsync.layout.logical import logical_tensors, model_tensors
from shardsync.piece import RankLayout, TensorMeta, whole
from shardsync.spec import ModelSpec


def full_rank(label: str, names: Sequence[str], logical: dict[str, tuple[int, ...]],
              dtype: str) -> RankLayout:
    return RankLayout(
        label,
        tuple(TensorMeta(n, logical[n], dtype) for n in names),
        tuple(whole(n, n, logical) for n in names),
    )


@gc_paused
def full_layout(spec: ModelSpec, *, replicas: int = 1, dtype: str | None = None,
                names: Sequence[str] | None = None) -> Layout:
    """``replicas`` ranks, each holding every tensor of the model (or ``names``) whole: an
    engine's loader takes no MTP layer into its serving model."""
    logical = logical_tensors(spec)
    names = list(model_tensors(spec)) if names is None else list(names)
    one = full_rank("full0", names, logical, dtype or spec.dtype)  # replicas share its tuples
    ranks = tuple(RankLayout(f"full{i}", one.tensors, one.pieces) for i in range(replicas))
    return Layout("full", spec, logical, ranks, (("replicas", replicas),))


@gc_paused
def stage_sources(layout: Layout, groups: Sequence[Sequence[int]]) -> Layout:
    """One full-tensor holder per rank group (e.g. per PP stage) of what the group holds.

    A logical tensor held by several groups (a tied embedding on the first and last
    stage) goes to the first group only, so each tensor has exactly one source.
    """
    taken: set[str] = set()
    ranks = []
    for i, group in enumerate(groups):
        names: list[str] = []
        for r in group:
            for p in layout.ranks[r].pieces:
                if p.logical not in taken:
                    taken.add(p.logical)
                    names.append(p.logical)
        mine = set(names)
        order = [n for n in layout.logical if n in mine]
        ranks.append(full_rank(f"source{i}", order, layout.logical, layout.ranks[group[0]].tensors[0].dtype
                               if layout.ranks[group[0]].tensors else layout.spec.dtype))
    return Layout("full", layout.spec, layout.logical, tuple(ranks), (("sources", len(groups)),))
