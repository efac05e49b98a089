"""Where a receiver writes: the engine's live parameters in place, or the engine's own
loader fed checkpoint-format (HuggingFace-named) slices.

Both expose engine-layout tensors that every path writes into; ``commit`` runs after a
receive succeeded, before the engine serves the new version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from shardsync.layout.piece import RankLayout
from shardsync.plan.local import region


class Destination(Protocol):
    name: str

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Engine-layout local tensors (``layout.engine`` names) the paths write into."""
        ...

    def commit(self) -> None:
        """A receive into ``tensors()`` succeeded: make it the engine's weights."""
        ...


class Params:
    """The engine's live parameters, written in place (``commit`` has nothing left to do)."""

    name = "params"

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = dict(params)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._params

    def commit(self) -> None:
        return None


@dataclass(frozen=True)
class Slice:
    """A box of a HuggingFace checkpoint tensor: ``tensor`` is ``name[offsets : offsets+shape]``
    of a tensor whose full shape is ``full_shape``."""

    name: str
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]
    tensor: torch.Tensor


class Loader:
    """For engines whose parameters cannot be written directly (repacked, quantized): the
    receive lands in engine-layout staging tensors, and ``commit`` hands ``load`` every
    checkpoint-format slice this rank holds, tensor by tensor.

    Memory: one copy of this rank's shard (the staging tensors, kept across updates so a
    delta applies to the last values).
    """

    name = "loader"

    def __init__(self, rank: RankLayout, logical: Mapping[str, tuple[int, ...]],
                 load: Callable[[Iterator[Slice]], None], *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.rank, self.logical, self.load = rank, dict(logical), load
        self._staging = {t.name: torch.zeros(t.shape, dtype=dtype, device=device) for t in rank.tensors}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._staging

    def slices(self) -> Iterator[Slice]:
        for p in self.rank.pieces:
            yield Slice(p.logical, tuple(p.offsets), tuple(self.logical[p.logical]),
                        self._staging[p.local][region(tuple(p.local_offsets), tuple(p.sizes))])

    def commit(self) -> None:
        self.load(self.slices())
