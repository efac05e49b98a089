"""Tensors both ends hold wider than the wire (Megatron's and the engines' float32 expert bias
under a bfloat16 sync): they move as their own bits, never rounded to the wire dtype.

Read off the family's rows: a logical tensor is raw when a Megatron row and an engine row
that hold it whole or split (one source each) both give it the same dtype, wider than the
wire's.  Everything else is cast to the wire dtype, as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from shardsync.dtypes import torch_dtype
from shardsync.family.kinds import Split, Whole
from shardsync.family.table import Row
from shardsync.layout.logical import layer_blocks, mtp_layers
from shardsync.spec import ModelSpec


def _typed(rows: Iterable[Row], spec: ModelSpec, variants: frozenset[str]) -> dict[str, str]:
    """Source (within the layer) -> dtype of the rows that hold one source in their own dtype."""
    out = {}
    for row in rows:
        if row.dtype is not None and isinstance(row.kind, Whole | Split) and row.exists(spec, variants):
            out[row.kind.source or row.name] = row.dtype
    return out


def raw_dtypes(spec: ModelSpec, megatron: frozenset[str], engine: frozenset[str], wire: str) -> dict[str, str]:
    """Logical tensor -> the dtype its bits move in, for the tensors a Megatron trainer (layout
    variants ``megatron``) and an engine (``engine``) both hold wider than ``wire``."""
    width = torch_dtype(wire).itemsize
    out: dict[str, str] = {}
    for layer in (*range(spec.num_layers), *mtp_layers(spec)):
        for block, prefix in layer_blocks(spec, layer):
            theirs = _typed(block.engine, spec, engine)
            for source, dtype in _typed(block.megatron, spec, megatron).items():
                size = torch_dtype(dtype).itemsize
                if theirs.get(source) == dtype and size > width and size % width == 0:
                    out[prefix + source] = dtype
    return out


def width(raw: str | None, wire: str) -> int:
    """Wire elements one element takes: 1 when cast to the wire, its bytes over the wire's when raw."""
    return 1 if raw is None else torch_dtype(raw).itemsize // torch_dtype(wire).itemsize


def narrow_dtypes(spec: ModelSpec, engine: frozenset[str], wire: str) -> dict[str, str]:
    """Logical tensor -> the dtype an engine (layout variants ``engine``) holds it in, for those
    it holds narrower than ``wire`` (SGLang's bfloat16 indexer ``weights_proj``)."""
    width = torch_dtype(wire).itemsize
    out: dict[str, str] = {}
    for layer in (*range(spec.num_layers), *mtp_layers(spec)):
        for block, prefix in layer_blocks(spec, layer):
            for source, dtype in _typed(block.engine, spec, engine).items():
                if torch_dtype(dtype).itemsize < width:
                    out[prefix + source] = dtype
    return out
