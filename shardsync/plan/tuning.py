"""Which bucket size to pick for a plan on a fabric.

An update's busiest link moves ``B`` bytes in buckets of ``b``: each message costs its
bytes plus a fixed ``alpha`` (a launch, a handshake: ``Fabric.message_us``), and the pipeline
cannot hide the first bucket's pack nor the last one's unpack (``b`` over the copy speed
``gamma``).  The cost above the wire time, ``(B / b) * alpha + 2 * b / gamma``, is least at
``b* = sqrt(alpha * gamma * B / 2)``: small buckets pay per message, large ones stall the
pipeline (and hold ``credits * b`` of buffers).  ``docs/tuning.md`` checks the model against
a sweep on this machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardsync.plan.fabric import GB, Fabric

MIB = 1 << 20
SMALLEST, LARGEST = 1 * MIB, 1024 * MIB


@dataclass(frozen=True)
class Advice:
    bucket_bytes: int
    messages: int  # on the busiest link
    message_s: float  # what those messages cost beyond their bytes
    fill_s: float  # the pack of the first and the unpack of the last bucket, not overlapped
    why: str


def overhead_s(link_bytes: int, bucket_bytes: int, f: Fabric) -> float:
    """The model's cost above the wire time for one bucket size."""
    messages = max(1, math.ceil(link_bytes / bucket_bytes))
    return messages * f.message_us * 1e-6 + 2 * min(bucket_bytes, link_bytes) / (f.copy_gbytes_s * GB)


def recommend(link_bytes: int, f: Fabric, *, memory_bytes: int | None = None, credits: int = 2) -> Advice:
    """The power-of-two MiB bucket nearest the model's best for a busiest link of ``link_bytes``,
    within 1 MiB .. 1 GiB, the link itself, and ``memory_bytes`` of buffers (``credits`` in flight)."""
    best = math.sqrt(f.message_us * 1e-6 * f.copy_gbytes_s * GB * link_bytes / 2)
    cap = min(LARGEST, max(link_bytes, SMALLEST))
    why = f"sqrt(message cost x copy speed x busiest link / 2) on {f.name}"
    if memory_bytes is not None and memory_bytes // credits < cap:
        cap = max(SMALLEST, memory_bytes // credits)
        why += f", {credits} buckets in flight within {memory_bytes / MIB:.0f} MiB"
    sizes = [SMALLEST << i for i in range(11) if SMALLEST << i <= cap] or [SMALLEST]
    pick = min(sizes, key=lambda b: overhead_s(link_bytes, b, f))  # the model's own best of the round sizes
    messages = max(1, math.ceil(link_bytes / pick))
    return Advice(pick, messages, messages * f.message_us * 1e-6, 2 * min(pick, link_bytes) / (f.copy_gbytes_s * GB),
                  f"{why}: {best / MIB:.0f} MiB")
