"""Checksums: independent of how a tensor is cut, of how many rows are hashed per pass, and
changed by any one bit."""

from __future__ import annotations

import torch

from shardsync.runtime import checksum
from shardsync.runtime.checksum import box_checksum


def test_row_chunks_and_shards_sum_to_the_one_pass_checksum(monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randn(37, 11, generator=g).to(torch.bfloat16)
    whole = box_checksum(t, (0, 0), (37, 11), torch.bfloat16)
    halves = box_checksum(t[:20], (0, 0), (37, 11), torch.bfloat16) + box_checksum(t[20:], (20, 0), (37, 11),
                                                                                   torch.bfloat16)
    assert halves == whole
    monkeypatch.setattr(checksum, "CHUNK", 30)  # two or three rows per pass
    assert box_checksum(t, (0, 0), (37, 11), torch.bfloat16) == whole
    assert box_checksum(t[5:], (5, 0), (37, 11), torch.bfloat16) == whole - box_checksum(
        t[:5], (0, 0), (37, 11), torch.bfloat16)
    flipped = t.clone()
    flipped.view(torch.int16)[36, 10] ^= 1  # one bit of the last element (in the last chunk)
    assert box_checksum(flipped, (0, 0), (37, 11), torch.bfloat16) != whole
