"""Bench world partitioning: trainer ranks first, engine groups after, every rank once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardsync.bench.topology import partition


def test_homogeneous_groups_follow_the_trainer_ranks() -> None:
    lay = partition(5, group_size=2)
    assert lay.trainers == (0,)
    assert lay.groups == ((1, 2), (3, 4))
    assert [lay.group_of(r) for r in range(5)] == [None, 0, 0, 1, 1]


def test_heterogeneous_groups_and_several_trainers() -> None:
    lay = partition(10, trainer_ranks=3, group_sizes=(2, 1, 4))
    assert lay.trainers == (0, 1, 2)
    assert lay.groups == ((3, 4), (5,), (6, 7, 8, 9))
    # senders round-robin over trainer ranks; data group = sender + group, control = trainers + group
    assert [lay.sender(g) for g in range(3)] == [0, 1, 2]
    sub = lay.subgroups()
    assert sub["data2"] == [2, 6, 7, 8, 9]
    assert sub["ctrl1"] == [0, 1, 2, 5]
    assert list(sub) == ["data0", "ctrl0", "data1", "ctrl1", "data2", "ctrl2"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"group_size": 3}, "cannot be split into groups of 3"),
    ({"group_sizes": (2, 1)}, "rank 4 is in no group"),
    ({"group_sizes": (2, 1, 4)}, "beyond the last rank 4"),
    ({"group_sizes": (2, 0, 2)}, "positive sizes"),
    ({}, "exactly one of"),
    ({"group_size": 2, "group_sizes": (2, 2)}, "exactly one of"),
    ({"group_size": 1, "trainer_ranks": 5}, "no engine rank"),
    ({"group_size": 1, "trainer_ranks": 0}, "at least 1"),
])
def test_invalid_layouts_are_refused_with_the_reason(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(5, **kwargs)


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.integers(1, 3))
def test_any_world_is_covered_exactly_once(sizes: list[int], trainers: int) -> None:
    world = trainers + sum(sizes)
    lay = partition(world, trainer_ranks=trainers, group_sizes=sizes)
    ranks = list(lay.trainers) + [r for g in lay.groups for r in g]
    assert sorted(ranks) == list(range(world)) == ranks
    assert [len(g) for g in lay.groups] == sizes
    if len(set(sizes)) == 1:
        assert partition(world, trainer_ranks=trainers, group_size=sizes[0]) == lay
