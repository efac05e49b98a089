"""Bitwise, layout-independent checksums of logical tensors.

Each element contributes a 32-bit mix of (its flat logical index, its bits in the wire
dtype); a tensor's checksum is the exact integer sum.  The sum does not depend on how
the tensor is cut into pieces, so trainer shards and engine shards of the same values
give the same number per logical tensor, whatever the TP sizes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from shardsync.dtypes import torch_dtype
from shardsync.piece import RankLayout

_BITS = {torch.float32: (torch.int32, 0xFFFFFFFF), torch.bfloat16: (torch.int16, 0xFFFF),
         torch.float16: (torch.int16, 0xFFFF), torch.int32: (torch.int32, 0xFFFFFFFF)}  # int32: FP8 words
_M = 0xFFFFFFFF

BoxKey = tuple[str, tuple[int, ...], tuple[int, ...]]


def _flat_index(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...],
                device: torch.device | str = "cpu") -> torch.Tensor:
    idx = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for dim in reversed(range(len(shape))):
        ax = torch.arange(offsets[dim], offsets[dim] + sizes[dim], dtype=torch.int64, device=device) * stride
        idx = idx.unsqueeze(0) + ax.view(-1, *([1] * idx.dim()))
        stride *= shape[dim]
    return idx


CHUNK = 1 << 24  # elements hashed per pass: the int64 temporaries stay near 0.5 GiB for any box


def box_checksum(values: torch.Tensor, offsets: tuple[int, ...], logical_shape: tuple[int, ...],
                 dtype: torch.dtype) -> int:
    """Checksum contribution of ``values`` (a box of a logical tensor), cast to ``dtype``;
    hashed in row chunks of about ``CHUNK`` elements (the sum is the same: a Qwen3-14B
    embedding in one pass took ~30 GB of temporaries beside a staged engine's two copies)."""
    if values.dim() > 0 and values.shape[0] > 1 and values.numel() > CHUNK:
        rows = max(1, CHUNK // max(1, values[0].numel()))
        return sum(box_checksum(values[i:i + rows], (offsets[0] + i, *offsets[1:]), logical_shape, dtype)
                   for i in range(0, values.shape[0], rows))
    int_dtype, mask = _BITS[dtype]
    bits = values.detach().to(dtype).contiguous().view(int_dtype).to(torch.int64) & mask
    idx = _flat_index(offsets, tuple(values.shape), logical_shape, bits.device)
    h = (bits * 0x2545F491 + idx * 0x1B873593 + 0x3C6EF372) & _M
    h = h ^ (h >> 16)
    h = (h * 0x2C1B3C6D) & _M
    h = h ^ (h >> 15)
    return int(h.sum())


def piece_checksums(rank: RankLayout, tensors: Mapping[str, torch.Tensor],
                    logical: Mapping[str, tuple[int, ...]], dtype: torch.dtype,
                    raw: Mapping[str, str] | None = None) -> dict[BoxKey, int]:
    """Checksums of every piece a rank holds, keyed by its logical box: in ``dtype``, the
    logical tensors ``raw`` names (``Topology.check_dtypes``: raw ones, narrower engine ones) in theirs."""
    out: dict[BoxKey, int] = {}
    raw = raw or {}
    for p in rank.pieces:
        region = tuple(slice(o, o + s) for o, s in zip(p.local_offsets, p.sizes, strict=True))
        own = raw.get(p.logical)
        out[(p.logical, p.offsets, p.sizes)] = box_checksum(
            tensors[p.local][region], p.offsets, logical[p.logical], dtype if own is None else torch_dtype(own))
    return out


def combine(parts: Iterable[Mapping[BoxKey, int]]) -> dict[str, int | None]:
    """Per logical tensor: the sum over distinct boxes (replicas of a box count once).

    Replicas that disagree (a norm stale on one engine rank) make the tensor's entry None.
    """
    boxes: dict[BoxKey, int | None] = {}
    for part in parts:
        for key, value in part.items():
            if key in boxes and boxes[key] != value:
                boxes[key] = None
            else:
                boxes.setdefault(key, value)
    out: dict[str, int | None] = {}
    for (name, _, _), box in boxes.items():
        prev = out.get(name, 0)
        out[name] = None if prev is None or box is None else prev + box
    return out


def compare(expected: Mapping[str, int | None], actual: Mapping[str, int | None]) -> list[str]:
    """Names of logical tensors whose checksums differ or are missing on one side."""
    names = set(expected) | set(actual)
    return sorted(n for n in names if expected.get(n) is None or expected.get(n) != actual.get(n))
