"""The recommended bucket size (``plan/tuning.py``): the model's best round size, within the
link, the memory given and 1 MiB .. 1 GiB; larger links and costlier messages want larger
buckets."""

from __future__ import annotations

import pytest

from shardsync.plan.fabric import FABRICS
from shardsync.plan.tuning import MIB, overhead_s, recommend


@pytest.mark.parametrize("name", sorted(FABRICS))
def test_the_pick_is_the_models_best_power_of_two(name: str) -> None:
    f = FABRICS[name]
    for link in (3 * MIB, 700 * MIB, 15 * 10**9):
        a = recommend(link, f)
        sizes = [MIB << i for i in range(11) if MIB << i <= max(link, MIB)]
        assert a.bucket_bytes in sizes
        assert overhead_s(link, a.bucket_bytes, f) == min(overhead_s(link, b, f) for b in sizes)
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
