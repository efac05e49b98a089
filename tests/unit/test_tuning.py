"""The recommended bucket size (``plan/tuning.py``): the model's best round size, within the
link, the memory given and 1 MiB .. 1 GiB; larger links and costlier messages want larger
buckets."""

from __future__ import annotations

import math

import pytest

from shardsync.plan.fabric import FABRICS
from shardsync.plan.tuning import MIB, overhead_s, recommend


@pytest.mark.parametrize("name", sorted(FABRICS))
def test_the_pick_is_a_round_size_next_to_the_closed_form_optimum(name: str) -> None:
    """Unclamped, the pick is within a factor 2 of b* = sqrt(alpha x gamma x B / 2), and no
    neighbouring power of two costs less by the model."""
    f = FABRICS[name]
    for link in (700 * MIB, 15 * 10**9):
        a = recommend(link, f)
        best = math.sqrt(f.message_us * 1e-6 * f.copy_gbytes_s * 1e9 * link / 2)
        assert a.bucket_bytes & (a.bucket_bytes - 1) == 0 and a.bucket_bytes % MIB == 0
        if MIB < best < 512 * MIB:
            assert a.bucket_bytes / 2 <= best <= a.bucket_bytes * 2, (a, best)
        for neighbour in (a.bucket_bytes // 2, a.bucket_bytes * 2):
            if MIB <= neighbour <= min(link, 1 << 30):
                assert overhead_s(link, a.bucket_bytes, f) <= overhead_s(link, neighbour, f)
        assert a.messages == -(-link // a.bucket_bytes)


def test_larger_links_and_costlier_messages_want_larger_buckets() -> None:
    f = FABRICS["ib400"]
    picks = [recommend(link, f).bucket_bytes for link in (64 * MIB, 1 << 30, 16 << 30, 256 << 30)]
    assert picks == sorted(picks) and picks[0] < picks[-1]
    slow = FABRICS["cpu-gloo"]
    assert recommend(1 << 30, slow).bucket_bytes != recommend(1 << 30, f).bucket_bytes


def test_memory_caps_the_buckets_in_flight() -> None:
    a = recommend(64 << 30, FABRICS["nvlink4"], memory_bytes=256 * MIB, credits=2)
    assert a.bucket_bytes == 128 * MIB and "within 256 MiB" in a.why
    assert recommend(100, FABRICS["nvlink4"]).bucket_bytes == MIB  # never below 1 MiB
