"""Which device a process rank computes on (trainer ranks and engine TP workers alike)."""

from __future__ import annotations

import torch


def rank_device(device: str, rank: int, count: int | None = None) -> str:
    """``cuda`` puts ranks on consecutive GPUs from 0, ``cuda:K`` from K (an engine next to a
    trainer on GPUs 0..K-1), wrapping around the ``count`` visible GPUs (one GPU: every rank
    on it); any other device is returned as given."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count() if count is None else count
    if count < 1:
        raise ValueError(f"device {device!r} but no CUDA device is visible")
    return f"cuda:{(base + rank) % count}"
