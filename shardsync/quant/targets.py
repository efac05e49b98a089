"""Which engine tensors an FP8 engine holds quantized, and their scale tensors.

SGLang's and vLLM's ``Fp8Config`` quantize every parallel linear layer and the fused experts;
the embedding, the LM head, norms and the MoE router stay in the model dtype.  The family
tables say which: an engine row with ``fp8=True`` (``family.table.Row``), read off the
engine layout's ``TensorMeta.fp8``.  Each quantized
weight ``x`` gains ``x + fmt.scale_suffix`` (``qkv_proj.weight_scale_inv``,
``experts.w13_weight_scale_inv``), float32.  A shard quantizes to the slice of the full
tensor's quantization only when every piece it holds is whole blocks: ``quantized`` refuses
shapes where a block would mix two logical tensors (SGLang refuses the same at load), or
where a block of the shard is not a block of the checkpoint's grid.  Per-channel scales are
per row of the shard (what an engine quantizing its own shard online computes): a column
shard of a row-parallel layer has its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.family.table import Supports
from shardsync.layout.logical import logical_tensors
from shardsync.piece import Piece, RankLayout
from shardsync.quant.fp8 import Fp8Format
from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class Target:
    """One quantized engine tensor: its name, the shape its owner holds, its scale's name and shape."""

    name: str
    shape: tuple[int, ...]
    scale: str
    scale_shape: tuple[int, ...]


def check_family(spec: ModelSpec) -> None:
    """Refuse families whose engines quantize linears this table does not name."""
    blocks = [spec.family_table.blocks(spec, layer)[0] for layer in range(spec.num_layers)]
    missing = sorted({str(b.kind) for b in blocks if Supports.FP8 not in b.supports})
    if missing:
        raise ValueError(f"{spec.name}: FP8 engines are supported for attention blocks that declare it (their "
                         f"Block.supports); this model has {missing} attention (its other linears are not in "
                         "shardsync's FP8 table); serve it unquantized")


def quantized(rank: RankLayout, spec: ModelSpec, fmt: Fp8Format) -> dict[str, Target]:
    """This engine rank's quantized tensors by name (layout order).  ValueError when a piece
    of one is not whole blocks (the shard would not be the full tensor's blocks)."""
    check_family(spec)
    logical = logical_tensors(spec)
    pieces: dict[str, list[Piece]] = {}
    for p in rank.pieces:
        pieces.setdefault(p.local, []).append(p)
    out: dict[str, Target] = {}
    for meta in rank.tensors:
        if not meta.fp8:
            continue
        rows, cols = meta.shape[-2:]
        for p in pieces.get(meta.name, ()):
            (r0, c0), (nr, nc) = p.local_offsets[-2:], p.sizes[-2:]
            if not (fmt.whole_blocks(p.local_offsets, p.sizes, meta.shape)
                    and (fmt.block is None or fmt.whole_blocks(p.offsets, p.sizes, logical[p.logical]))):
                bm, bn = fmt.blocks(logical[p.logical])
                raise ValueError(
                    f"{meta.name} [{rows}, {cols}] holds {p.logical} rows {p.offsets[0]}:{p.offsets[0] + nr}, "
                    f"columns {p.offsets[1]}:{p.offsets[1] + nc} at rows {r0}, columns {c0}: not whole "
                    f"{bm} x {bn} blocks of both, so its FP8 scales would not be the checkpoint's (SGLang refuses "
                    "the same shapes); pick an engine TP whose shards are multiples of the block, or another format")
        out[meta.name] = Target(meta.name, meta.stored, meta.name + fmt.scale_suffix, fmt.scale_shape(meta.stored))
    return out
