"""How a row's local tensors are cut from logical ones: ``Kind``, the rule a family row names,
and ``Cut``, where one rank sits when it cuts a layer.

The kinds are open: a family with an odd tensor declares its own ``Kind`` in its own module
(as a Megatron-Bridge bridge keeps its odd mappings), and every layout that holds the row cuts
it through ``Kind.cut`` without knowing the kind.  The shared kinds are in ``kinds.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from shardsync.piece import Box, Piece, TensorMeta

if TYPE_CHECKING:
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
        held = None if self.held == self.shape else self.held
        return TensorMeta(self.name, self.shape, dtype, held, fp8=self.fp8)


@dataclass(frozen=True)
class Experts:
    """Where a rank sits among the routed experts: expert-parallel size and rank (a block of
    ``E / ep`` experts each), expert-TP size and rank (each expert's MLP split over them).
    ``names``: the local experts' (fc1, fc2) name templates (``{j}``: the local index) and
    ``grouped``: every fc1 registered before every fc2 (Megatron's TE grouped GEMM)."""

    ep: int = 1
    ep_rank: int = 0
    tp: int = 1
    tp_rank: int = 0
    names: tuple[str, str] = ("", "")
    grouped: bool = False


@dataclass(frozen=True)
class Cut:
    """Where one rank sits when it cuts a layer: the layer's local and HF name prefixes, the
    tensor-parallel split dense rows follow, its place among the experts, and the fields row
    names are formatted with."""

    spec: ModelSpec
    layer: int
    local: str  # the local names' prefix (Megatron: ``decoder.layers.{local}.``)
    tp: int
    rank: int
    logical: dict[str, Box]
    names: dict[str, str] = field(default_factory=dict)
    variants: frozenset[str] = frozenset()  # the layout's variant words (``Row.exists``)
    hf_prefix: str = ""  # the logical names' prefix when not ``model.layers.{layer}.`` (MTP layers)
    experts: Experts = Experts()

    @property
    def hf(self) -> str:
        return self.hf_prefix or f"model.layers.{self.layer}."


class Kind:
    """A rule that cuts the local tensors of a row (``row``: its name in the table, ``name``:
    the local name it formats to) for the rank ``c`` describes.
    ``per_expert``: what it cuts depends on the rank's expert coordinates, not its TP rank (a
    layout cuts it once per expert holder).  ``layouts``: the tables it may stand in (a block
    refuses it in another, at import), ``None`` every one."""

    per_expert: ClassVar[bool] = False
    layouts: ClassVar[frozenset[str] | None] = None

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        raise NotImplementedError(f"{type(self).__name__} declares no cut rule")
