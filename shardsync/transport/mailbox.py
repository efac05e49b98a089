"""A mapped link's signals as words in shared host memory: the trainer's header, the
engine's ack and (push) the engine's next staging set, each a numbered record in one small
CPU tensor both processes map.

Over gloo each signal costs a socket hop and a wake of its helper thread (~0.3 ms per header
on the H200 host); a record here is read by polling a word.  A record is [number, check,
payload...]; the writer stores the payload, then the check, then the number, and a reader
takes a record only when its check matches what it read, so a read racing the write (or a
host that reorders stores) is retried instead of taken torn.  Readers poll, spinning briefly
(``os.sched_yield``: a ``time.sleep(0)`` takes ~50-100 us of timer slack) and then sleeping
in growing steps up to ``PAUSE_S``, always under a deadline.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

SLOT = 16  # words per record: number, check, up to 14 payload words
HEADER, ACK, STAGED = 0, 1, 2  # the sender's slot, the receiver's slot, the receiver's staging (push)
SLOTS = 3
SPIN_S = 2e-3  # polls only yield the CPU this long before the first sleep (most signals land within it)
PAUSE_S = 1e-3  # the longest sleep between polls
_MASK = (1 << 63) - 1


def _check(number: int, payload: Sequence[int]) -> int:
    h = (number * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _MASK
    for w in payload:
        h = ((h ^ (w & _MASK)) * 0x100000001B3 + 1) & _MASK
    return h


class Mailbox:
    """``SLOTS`` record slots over a shared int64 tensor: the sender wraps ``words()`` once it was
    exported (exporting moves it into shared memory), the receiver the tensor it mapped."""

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu" or tensor.dtype != torch.int64 or tensor.numel() != SLOTS * SLOT \
                or not tensor.is_contiguous():
            raise ValueError(f"a mailbox is {SLOTS * SLOT} contiguous int64 words in host memory, got "
                             f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}")
        self.tensor = tensor
        self._words = tensor.numpy()

    @staticmethod
    def words() -> torch.Tensor:
        return torch.zeros(SLOTS * SLOT, dtype=torch.int64)

    def post(self, slot: int, number: int, payload: Sequence[int]) -> None:
        if len(payload) > SLOT - 2 or number <= 0:
            raise ValueError(f"a record holds up to {SLOT - 2} words under a number > 0")
        base, w = slot * SLOT, self._words
        w[base + 2:base + 2 + len(payload)] = payload
        w[base + 1] = _check(number, payload)
        w[base] = number

    def _read(self, slot: int, size: int) -> tuple[int, list[int]] | None:
        base, w = slot * SLOT, self._words
        number = int(w[base])
        payload = w[base + 2:base + 2 + size].tolist()
        if number <= 0 or int(w[base + 1]) != _check(number, payload) or int(w[base]) != number:
            return None
        return number, payload

    def take(self, slot: int, size: int, *, after: int, timeout_s: float, what: str) -> tuple[int, list[int]]:
        """The first record numbered above ``after`` (``size`` payload words); a ``TimeoutError``
        naming ``what`` if none lands within ``timeout_s``."""
        t0 = time.monotonic()
        pause = 5e-5
        while True:
            got = self._read(slot, size)
            if got is not None and got[0] > after:
                return got
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise TimeoutError(f"no {what} within {timeout_s:g}s (the other process is gone or stuck)")
            if now - t0 < SPIN_S:
                os.sched_yield()  # lets this process's other threads run
            else:
                time.sleep(pause)
                pause = min(pause * 2, PAUSE_S)
