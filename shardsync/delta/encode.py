"""Encodings of one part (a box of a logical tensor held by one trainer rank).

Values are always new values, never differences, so dense and sparse payloads apply
exactly and idempotently.  Per part the smallest of:

- ``dense``: every value;
- ``sparse32``: int32 flat positions + values;
- ``gap16``: uint16 gaps between positions + values (a gap over 65535 is bridged by a
  filler entry that rewrites an unchanged element with its own value);

and for files, ``xor``: the new bytes XOR the previous bytes, zstd-compressed (applied
exactly once, on the right base: the manifest names it).

Wire form of a part: int64 header ``[encoding, count]`` then the payload bytes.
"""

from __future__ import annotations

import torch

DENSE, SPARSE32, GAP16, XOR = 0, 1, 2, 3
NAMES = {DENSE: "dense", SPARSE32: "sparse32", GAP16: "gap16", XOR: "xor"}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
HEADER = 16


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a same-size integer view (flattened, contiguous)."""
    t = t.contiguous().reshape(-1)
    return t.view(_INT[t.element_size()])


def changed_positions(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat positions whose bits differ (bitwise: -0.0 vs 0.0 and NaN payloads count)."""
    return torch.nonzero(bits(new) != bits(old)).reshape(-1)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _gaps(pos: torch.Tensor) -> torch.Tensor:
    """Positions -> gaps (first gap from -1), with fillers so every gap fits in uint16."""
    prev = torch.cat([torch.tensor([-1], dtype=torch.int64, device=pos.device), pos[:-1]])
    gaps = pos - prev
    if int(gaps.max()) <= 65535:
        return gaps
    out, last = [], -1
    for p in pos.tolist():  # rare: only parts with long unchanged runs
        while p - last > 65535:
            last += 65535
            out.append(65535)
        out.append(p - last)
        last = p
    return torch.tensor(out, dtype=torch.int64)


def encode(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Smallest value-encoding of ``new`` against ``old`` (same shape and dtype), as bytes."""
    n, item = new.numel(), new.element_size()
    flat = new.contiguous().reshape(-1)
    pos = changed_positions(new, old)
    k = pos.numel()
    sizes = {DENSE: n * item, SPARSE32: k * (4 + item)}
    gaps = None
    if k:
        gaps = _gaps(pos)
        sizes[GAP16] = gaps.numel() * (2 + item)
    enc = min(sizes, key=lambda e: (sizes[e], e))
    if enc == DENSE:
        count, payload = n, [_bytes(flat)]
    elif enc == SPARSE32:
        count, payload = k, [_bytes(pos.to(torch.int32)), _bytes(flat[pos])]
    else:
        assert gaps is not None
        filled = torch.cumsum(gaps, 0) - 1
        count, payload = gaps.numel(), [_bytes(gaps.to(torch.int32).to(torch.int16)), _bytes(flat[filled])]
    header = torch.tensor([enc, count], dtype=torch.int64, device=new.device).view(torch.uint8)
    return torch.cat([header, *payload]) if payload else header


def decode(data: torch.Tensor, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(flat positions or None for dense, values) of an encoded part."""
    enc, count = data[:HEADER].clone().view(torch.int64).tolist()
    body = data[HEADER:]
    item = torch.empty((), dtype=dtype).element_size()

    def view(a: int, b: int, as_dtype: torch.dtype) -> torch.Tensor:
        return body[a:b].clone().view(as_dtype)  # clone: slices may be unaligned

    if enc == DENSE:
        if count != numel:
            raise ValueError(f"dense part holds {count} values, expected {numel}")
        return None, view(0, numel * item, dtype)
    if enc == SPARSE32:
        return view(0, 4 * count, torch.int32).to(torch.int64), view(4 * count, (4 + item) * count, dtype)
    if enc == GAP16:
        gaps = view(0, 2 * count, torch.int16).to(torch.int64) & 0xFFFF
        return torch.cumsum(gaps, 0) - 1, view(2 * count, (2 + item) * count, dtype)
    raise ValueError(f"unknown part encoding {enc}")


def encoding_of(data: torch.Tensor) -> str:
    return NAMES[int(data[:HEADER].clone().view(torch.int64)[0])]


def xor_encode(new: torch.Tensor, old: torch.Tensor, level: int = 1) -> bytes:
    import zstandard

    x = (bits(new) ^ bits(old)).view(torch.uint8).numpy().tobytes()
    return zstandard.ZstdCompressor(level=level).compress(x)


def xor_decode(blob: bytes, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The XOR mask of a part, as integer bits shaped flat ``[numel]``."""
    import zstandard

    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=numel * 8 + 64)
    item = torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(bytearray(raw), dtype=_INT[item])[:numel]
