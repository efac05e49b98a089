"""Engine-wave policies, their bounds, and the global order each rank follows a part of."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardsync.bench.policy import plan_waves
from shardsync.bench.schedule import Done, Go, Xfer, global_order, rank_program
from shardsync.bench.topology import partition
from shardsync.bench.workload import synthetic


def test_three_policies_waves_and_bounds() -> None:
    assert plan_waves("all_at_once", 5).waves == ((0, 1, 2, 3, 4),)
    assert plan_waves("serialized", 3).waves == ((0,), (1,), (2,))
    w = plan_waves("windowed", 5, window=2)
    assert w.waves == ((0, 1), (2, 3), (4,))
    assert (plan_waves("all_at_once", 5).bound, w.bound, plan_waves("serialized", 5).bound) == (5, 2, 1)
    assert plan_waves("windowed", 2, window=4).bound == 2


def test_stride_offsets_restart_every_wave() -> None:
    w = plan_waves("windowed", 4, window=2, stride_s=1e-3)
    assert w.offsets() == {0: 0.0, 1: 1e-3, 2: 0.0, 3: 1e-3}


@pytest.mark.parametrize(("args", "match"), [
    (("windowed", 3), "--window"), (("bogus", 3), "not one of"), (("serialized", 0), "at least one")])
def test_bad_policies_are_refused(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        plan_waves(*args)


def _active_bound(ops) -> int:
    """Groups between their go and done in the global order, at most at once."""
    active, best = set(), 0
    for op in ops:
        if isinstance(op, Go):
            active.add(op.group)
        elif isinstance(op, Done):
            active.discard(op.group)
        best = max(best, len(active))
    return best


@given(st.sampled_from(["all_at_once", "windowed", "serialized"]), st.integers(1, 6), st.integers(1, 4),
       st.integers(1, 3), st.sampled_from([0.0, 5e-4]), st.sampled_from(["p2p", "broadcast"]))
def test_global_order_honours_the_bound_and_moves_every_message(policy, groups, window, count, stride,
                                                                  transport) -> None:
    lay = partition(1 + 2 * groups, group_size=2)
    wl = synthetic(lay, transport, nbytes=16, count=count)
    waves = plan_waves(policy, groups, window=window, stride_s=stride)
    ops = global_order(waves, wl)
    assert _active_bound(ops) == waves.bound
    sent = [op.msg for op in ops if isinstance(op, Xfer)]
    assert sorted(sent, key=repr) == sorted((m for ms in wl.messages for m in ms), key=repr)
    for op in ops:  # a message moves only while its group is between go and done
        if isinstance(op, Xfer):
            gos = [i for i, o in enumerate(ops) if isinstance(o, Go) and o.group == op.msg.group]
            dones = [i for i, o in enumerate(ops) if isinstance(o, Done) and o.group == op.msg.group]
            assert gos[0] < ops.index(op) < dones[0]


def test_rank_programs_are_subsequences_with_barriers_only_for_members() -> None:
    lay = partition(5, group_size=2)
    wl = synthetic(lay, "p2p", nbytes=8, count=2)
    ops = global_order(plan_waves("serialized", 2), wl)
    sender = rank_program(ops, 0, lay)
    assert [type(i).__name__ if not isinstance(i, tuple) else len(i) for i in sender] == \
        ["Go", 4, "Done", "Go", 4, "Done"]
    engine = rank_program(ops, 3, lay)
    assert [type(i).__name__ if not isinstance(i, tuple) else len(i) for i in engine] == ["Go", 2, "Done"]
    assert all(s.comm == ("recv", 0) for s in engine[1])
    bcast = rank_program(global_order(plan_waves("all_at_once", 2), synthetic(lay, "broadcast", nbytes=8, count=1)),
                         0, lay)
    assert [s.comm for s in bcast[2]] == [("bcast", "data0", 0, True), ("bcast", "data1", 0, True)]


def test_stride_puts_each_go_before_its_groups_first_message() -> None:
    lay = partition(5, group_size=2)
    ops = global_order(plan_waves("all_at_once", 2, stride_s=1e-3), synthetic(lay, "broadcast", nbytes=8, count=2))
    kinds = [(type(o).__name__, o.msg.group if isinstance(o, Xfer) else o.group) for o in ops]
    assert kinds == [("Go", 0), ("Xfer", 0), ("Go", 1), ("Xfer", 1), ("Xfer", 0), ("Xfer", 1),
                     ("Done", 0), ("Done", 1)]
    assert [o.offset_s for o in ops if isinstance(o, Go)] == [0.0, 1e-3]
