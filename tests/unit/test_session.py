"""The engine's update session as a state machine: transitions and typed refusals, no processes."""

from __future__ import annotations

import pytest

from shardsync.control.session import (
    Conflict,
    Invalid,
    NotConnected,
    NotFound,
    Stale,
    State,
    UpdateSession,
)
from shardsync.control.wire import BeginRequest, ConnectRequest
from shardsync.runtime.ledger import UpdateResult


def _connected() -> UpdateSession:
    s = UpdateSession()
    s.fingerprints = {"p2p": "fp-p2p", "broadcast": "fp-b"}
    return s


def _begin(version: int, mode: str = "p2p", fp: str = "fp-p2p", base: int | None = None) -> BeginRequest:
    return BeginRequest(version=version, mode=mode, fingerprint=fp, base_version=base)


def _result(version: int, mode: str = "p2p", ok: bool = True) -> UpdateResult:
    return UpdateResult(version=version, mode=mode, ok=ok, error=None if ok else "boom", total_s=0.5,
                        bytes_received=10)


def test_commit_moves_idle_to_receiving_to_idle_on_the_new_version() -> None:
    s = _connected()
    assert s.state is State.IDLE and s.version == 0
    s.begin(_begin(3))
    assert s.state is State.RECEIVING
    with pytest.raises(Conflict, match="another update is in progress"):
        s.begin(_begin(4))
    s.settle(_result(3))
    assert (s.state, s.version, s.stale) == (State.IDLE, 3, False)
    sample = s.metrics.registry.get_sample_value
    assert sample("shardsync_updates_total", {"path": "p2p", "outcome": "ok"}) == 1
    assert sample("shardsync_update_received_bytes_total", {"path": "p2p"}) == 10
    s.check_servable()


def test_a_failed_update_is_stale_until_a_full_update_and_drops_the_connection() -> None:
    s = _connected()
    s.begin(_begin(1))
    s.settle(_result(1, ok=False))
    assert s.state is State.STALE and s.version == 0 and not s.connected
    with pytest.raises(Stale, match="update 1 failed: boom"):
        s.check_servable()
    with pytest.raises(NotConnected):
        s.begin(_begin(2))
    s.fingerprints = {"p2p": "fp-p2p", "broadcast": "fp-b"}  # a trainer reconnected
    with pytest.raises(Conflict, match="stale"):  # a delta cannot repair stale weights
        s.begin(_begin(2, mode="delta-p2p", base=0))
    s.begin(_begin(2))
    assert s.stale, "still stale while the repairing update runs"
    s.settle(_result(2))
    assert s.state is State.IDLE and s.version == 2 and not s.stale


@pytest.mark.parametrize("req,error,match", [
    (_begin(5, fp="other"), Conflict, "does not match the connected plan"),
    (_begin(5, mode="broadcast"), Conflict, "does not match"),  # the p2p fingerprint for broadcast
    (_begin(1), Conflict, "older than the engine's 2"),
    (_begin(5, mode="delta-p2p"), Invalid, "needs base_version"),
    (_begin(5, mode="delta-p2p", base=1), Conflict, "holds version 2"),
])
def test_refusals_leave_the_weights_and_state_alone(req, error, match) -> None:
    s = _connected()
    s.begin(_begin(2))
    s.settle(_result(2))
    with pytest.raises(error, match=match):
        s.begin(req)
    assert (s.state, s.version) == (State.IDLE, 2)


def test_finish_of_an_update_never_begun_and_disconnect_during_an_update() -> None:
    s = _connected()
    with pytest.raises(NotFound):
        s.in_progress(7)
    s.begin(_begin(7))
    assert s.in_progress(7).version == 7
    with pytest.raises(Conflict, match="in progress"):
        s.disconnect()
    s.settle(_result(7))
    s.disconnect()
    assert not s.connected


def test_disk_pull_needs_the_served_base_and_no_connection() -> None:
    s = UpdateSession(version=4)
    with pytest.raises(Conflict, match="is a delta against 3"):
        s.begin_pull(5, 3)
    s.begin_pull(5, 4)
    s.settle(_result(5, mode="delta-disk"))
    assert s.version == 5
    assert s.metrics.registry.get_sample_value("shardsync_updates_total", {"path": "delta-disk", "outcome": "ok"}) == 1


def test_a_call_runs_once_in_order_and_a_join_starts_the_count_again() -> None:
    """The replay guard hosted ranks (vLLM, SGLang) run their calls through."""
    s = _connected()
    s.take_call(1)
    s.take_call(3)  # numbers may skip (checksum rounds count too)
    for seq in (3, 2):
        with pytest.raises(Conflict, match=f"call {seq} after call 3 on this connection"):
            s.take_call(seq)
    s.joined(ConnectRequest.model_construct(fingerprints={"p2p": "fp-p2p"}))
    s.take_call(1)


def test_older_versions_are_refused_only_where_versions_grow() -> None:
    grows, labels = _connected(), _connected()
    labels.versions_grow = False  # hosted engines: the engine labels versions; delta bases still checked
    for s in (grows, labels):
        s.begin(_begin(5))
        s.settle(_result(5))
    with pytest.raises(Conflict, match="older than the engine's 5"):
        grows.begin(_begin(2))
    labels.begin(_begin(2))
    labels.settle(_result(2))
    assert labels.version == 2
    with pytest.raises(Conflict, match="this engine holds version 2"):
        labels.begin(_begin(3, "delta-p2p", base=5))
