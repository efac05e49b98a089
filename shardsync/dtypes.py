"""Dtype names, the only form a dtype takes across a boundary (specs, plans, the wire,
handles, manifests), and the one table that turns a name into torch's dtype.

A name outside the table is refused rather than looked up on ``torch``: a name read from
the network or a file never reaches an arbitrary attribute.
"""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


def torch_dtype(name: str) -> torch.dtype:
    """torch's dtype named ``name`` (``"bfloat16"``); ValueError for a name not in the table."""
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {sorted(TORCH_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
