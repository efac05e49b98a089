"""Which device a rank (trainer rank or engine TP worker) runs on."""

import pytest

from shardsync.placement import rank_device


@pytest.mark.parametrize("device,count,expected", [
    ("cpu", 8, ["cpu"] * 4),
    ("cuda", 8, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ("cuda:4", 8, ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]),  # next to a trainer on GPUs 0-3
    ("cuda", 1, ["cuda:0"] * 4),  # one GPU: every worker shares it
    ("cuda:1", 2, ["cuda:1", "cuda:0", "cuda:1", "cuda:0"]),
])
def test_workers_take_consecutive_gpus(device: str, count: int, expected: list[str]) -> None:
    assert [rank_device(device, r, count) for r in range(4)] == expected


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        rank_device("cuda", 0, 0)
