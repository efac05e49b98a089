"""``launch.procs.run_ranks``: results by rank, and a rank that dies fails the run at once."""

from __future__ import annotations

import os

import pytest

from shardsync.launch.procs import run_ranks


def _square(rank: int, base: int, out) -> None:
    out.put((rank, base + rank * rank))


def _dies(rank: int, out) -> None:
    if rank == 1:
        os._exit(3)
    out.put((rank, "ok"))


def test_results_come_back_by_rank() -> None:
    assert run_ranks(_square, 3, (10,), timeout_s=60) == {0: 10, 1: 11, 2: 14}


def test_a_rank_that_dies_fails_the_run_naming_it() -> None:
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] exited with \[3\]"):
        run_ranks(_dies, 2, (), timeout_s=60)
