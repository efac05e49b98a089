"""Byte counts as people read them (``shardsync plan``, the views' summaries)."""

from __future__ import annotations


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit below it: ``12 B``, ``1.50 KiB``, ``3.25 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return str(n)
