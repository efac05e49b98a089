"""Staged destinations with a staging window: which tensors are staged, where writes land,
when the gate (the engine's pause) is asked for, and what commit and catch-up leave served."""

from __future__ import annotations

import pytest
import torch

from shardsync.receiver import Staged
from shardsync.runtime.gated import Gated


def _params(n: int = 4) -> dict[str, torch.nn.Parameter]:
    return {f"l{i}": torch.nn.Parameter(torch.full((4,), float(i)), requires_grad=False) for i in range(n)}


def _staged(budget: int | None, order: list[str] | None = None) -> tuple[dict, Staged, list[int]]:
    params, gates = _params(), []
    d = Staged(params, budget=budget)
    d.gate = lambda: gates.append(1)
    if order is not None:
        d.plan_window(order)
    return params, d, gates


def test_the_window_is_what_the_receive_writes_first_within_the_budget() -> None:
    params, d, _ = _staged(budget=40, order=["l3", "l1", "l0", "l2"])  # 16 B each: two fit
    assert d.window == ("l3", "l1") and d.nbytes == 32 and d.shard_bytes == 64
    assert isinstance(d.tensors(), Gated) and d.tensors().window == {"l3", "l1"}
    whole = Staged(_params())
    assert whole.whole and not isinstance(whole.tensors(), Gated) and whole.nbytes == 64
    with pytest.raises(ValueError, match="positive"):
        Staged(_params(), budget=0)


def test_window_writes_are_staged_and_the_first_in_place_write_waits_for_the_gate_once() -> None:
    params, d, gates = _staged(budget=32, order=["l0", "l1", "l2", "l3"])
    d.prepare()
    t = d.tensors()
    t["l0"].fill_(10.0)
    t["l1"].fill_(11.0)
    assert gates == [] and not d.touched and float(params["l0"][0]) == 0.0, "served weights untouched so far"
    t["l2"].fill_(12.0)  # in place: the engine must be paused first
    t["l3"].fill_(13.0)
    assert gates == [1] and d.touched
    d.commit()
    assert [float(params[f"l{i}"][0]) for i in range(4)] == [10.0, 11.0, 12.0, 13.0]
    d.prepare()  # next receive: staging caught up with what is served (a delta's base)
    assert not d.touched and float(d.tensors()["l0"][0]) == 10.0 and gates == [1]
    d.tensors()["l0"].add_(1.0)
    d.commit()
    assert float(params["l0"][0]) == 11.0 and float(params["l1"][0]) == 11.0


def test_a_receive_that_fails_inside_the_window_leaves_the_served_weights() -> None:
    params, d, gates = _staged(budget=32, order=["l0", "l1"])
    d.prepare()
    d.tensors()["l0"].fill_(99.0)
    d.discard()
    assert not d.touched and gates == [] and float(params["l0"][0]) == 0.0
    d.prepare()
    assert float(d.tensors()["l0"][0]) == 0.0, "the discarded staging is caught up before the next receive"


def test_views_and_compiled_reads_keep_the_gate() -> None:
    """``mapped`` (the receiver's addressed views) keeps the gate; ``ungated`` reads never open it."""
    _, d, gates = _staged(budget=16, order=["l0"])
    views = d.tensors().mapped(lambda n, t: t.view(2, 2))
    assert views["l0"].shape == (2, 2) and gates == []
    assert set(views.ungated) == {"l0", "l1", "l2", "l3"} and gates == []
    views["l1"].zero_()
    assert gates == [1]


def test_a_pushing_writer_sees_both_sets_and_its_receive_catches_nothing_up() -> None:
    """``sets()``: set 0 the staging copies, set 1 the served storages (swap); a push receive
    (``overwrites``) runs no catch-up copy - it would race the writer's copies - and each
    commit moves ``staging_index`` to the set that was served."""
    params = _params()
    d = Staged(params)
    sets = d.sets()
    assert len(sets) == 2 and d.staging_index == 0
    assert all(sets[1][n].data_ptr() == params[n].data_ptr() for n in params)  # served storages
    for n in params:  # the writer fills set 0 from its process
        sets[0][n].fill_(7.0)
    d.prepare(overwrites=True)
    d.commit()
    assert d.staging_index == 1 and all(float(params[n][0]) == 7.0 for n in params)
    for n in params:  # the next update writes set 1 (the storages served before)
        sets[1][n].fill_(8.0)
    d.prepare(overwrites=True)  # a catch-up here would copy 7s over the pushed 8s
    assert all(float(sets[1][n][0]) == 8.0 for n in params)
    d.commit()
    assert d.staging_index == 0 and all(float(params[n][0]) == 8.0 for n in params)
    assert Staged(_params(), commit="copy").sets().__len__() == 1
    with pytest.raises(ValueError, match="whole staged shards"):
        _staged(budget=32, order=["l0"])[1].sets()


def test_in_place_destinations_follow_rebound_storage_and_derived_ones_pass_it_on() -> None:
    """An engine that rebinds a parameter's storage (SGLang's repacking methods may) must not
    leave the receive writing into the old one; staged destinations keep their own copies."""
    from shardsync.quant import FORMATS
    from shardsync.quant.targets import Target
    from shardsync.receiver import Params
    from shardsync.receiver.quantized import Quantized

    live = {"a": torch.zeros(4), "w": torch.zeros(128, 128, dtype=torch.float8_e4m3fn)}
    params = Params(live)
    assert not params.rebind(dict(live))  # the same storage: nothing to follow
    moved = {**live, "a": torch.ones(4)}
    assert params.rebind(moved) and params.tensors()["a"].data_ptr() == moved["a"].data_ptr()
    fp8 = Quantized(Params(live), {"w": Target("w", (128, 128), "w_scale_inv", (1, 1))}, FORMATS["fp8"],
                    dtype=torch.bfloat16)
    assert fp8.rebind(moved) and fp8.inner.tensors()["a"].data_ptr() == moved["a"].data_ptr()
    assert not Staged(live).rebind(moved)
