"""Trainer rank 0's store channel against the engine's store listener, in one process over a
real TCPStore: accepted updates return the engine's result, refusals come back with their
reason, and a value that is not the trainer's signed message is dropped without being executed."""

from __future__ import annotations

import datetime
import pickle
import threading
from concurrent.futures import Future

import pytest

from shardsync.control.client import StoreChannel, SyncError
from shardsync.control.listener import StoreListener
from shardsync.control.session import Conflict
from shardsync.control.wire import Accepted, BeginRequest
from shardsync.launch.procs import listening
from shardsync.runtime.ledger import UpdateResult
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.store.sealed import get
from shardsync.vocab import Refused

SECRET = "a-test-secret-0123456789"


class _Engine:
    """The engine side of the listener: refuses old versions, else completes the update."""

    def __init__(self) -> None:
        self.version = 0
        self.seen: list[int] = []

    def begin(self, req: BeginRequest) -> tuple[Future, Future]:
        """(started, result), as the engine's update service returns them."""
        self.seen.append(req.version)
        if req.version < self.version:
            raise Conflict(f"version {req.version} is older than the engine's {self.version}")
        fut: Future = Future()

        def finish() -> None:
            self.version = req.version
            fut.set_result(UpdateResult(version=req.version, mode=req.mode.value, ok=req.version != 13,
                                        error="receive failed" if req.version == 13 else None))

        started: Future = Future()
        threading.Timer(0.02, lambda: started.set_result(None)).start()
        threading.Timer(0.05, finish).start()
        return started, fut


@pytest.fixture()
def wired():
    rdv = Rendezvous("127.0.0.1", free_port(), 2, "ctl-test", timeout_s=10)
    store = open_store(rdv, is_master=True)
    engine = _Engine()
    listener = StoreListener(rdv, 0, engine.begin, SECRET)
    listener.start()
    channel = StoreChannel(store, Keys(rdv.name), ["http://engine0"], timeout_s=10, secret=SECRET)
    yield channel, engine, store
    listener.stop()


def _req(version: int) -> BeginRequest:
    return BeginRequest(version=version, mode="p2p", fingerprint="f")


def test_begin_finish_round_trip_and_a_refusal(wired) -> None:
    channel, engine, _ = wired
    channel.begin(_req(2))
    assert [r.version for r in channel.finish(2)] == [2] and engine.version == 2
    with pytest.raises(SyncError, match="refused update 1: version 1 is older"):
        channel.begin(_req(1))
    channel.begin(_req(3))  # the listener serves the next update after a refusal
    assert channel.finish(3)[0].ok
    channel.begin(_req(13))
    with pytest.raises(SyncError, match="update 13 failed: receive failed"):
        channel.finish(13)
    assert engine.seen == [2, 1, 3, 13]


def test_a_pipelined_refusal_is_answered_by_the_engine_and_read_at_finish() -> None:
    """``pipelined``: begin does not wait for the answer; a refusal first goes to ``refuse``
    (the engine answers the trainer's transport signal there), then comes back at finish as
    ``Refused``, and the next update is served."""
    rdv = Rendezvous("127.0.0.1", free_port(), 2, "ctl-pipe", timeout_s=10)
    store = open_store(rdv, is_master=True)
    engine = _Engine()
    engine.version = 5
    answered: list[int] = []

    def refuse(req: BeginRequest) -> Future:
        answered.append(req.version)
        done: Future = Future()
        done.set_result(None)
        return done

    listener = StoreListener(rdv, 0, engine.begin, SECRET, refuse=refuse)
    listener.start()
    try:
        channel = StoreChannel(store, Keys(rdv.name), ["http://engine0"], timeout_s=10, secret=SECRET)
        channel.begin(_req(4).model_copy(update={"pipelined": True}))  # returns before any answer
        with pytest.raises(Refused, match="refused update 4: version 4 is older"):
            channel.finish(4)
        assert answered == [4]
        channel.begin(_req(6).model_copy(update={"pipelined": True}))
        assert channel.finish(6)[0].ok and engine.version == 6 and answered == [4]
        with pytest.raises(SyncError, match="refused update 1"):  # not pipelined: refused at begin
            channel.begin(_req(1))
        assert answered == [4]  # nothing was signalled: nothing to answer
    finally:
        listener.stop()


class _Evil:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled')",))


def test_a_crafted_pickle_under_the_begin_key_is_dropped_unexecuted(wired) -> None:
    channel, engine, store = wired
    keys = channel.keys
    store.set(keys.begin(1), pickle.dumps(_Evil()))  # unpickled, it would stop the listener
    with pytest.raises(RuntimeError):  # no answer: an unsigned value is dropped
        get(store, keys.accepted(1, 0), Accepted, datetime.timedelta(seconds=1), SECRET)
    assert engine.seen == []
    channel.begin(_req(4))  # the trainer's signed begin under the same key is served
    assert channel.finish(4)[0].version == 4


def test_no_answer_is_a_bounded_sync_error() -> None:
    rdv = Rendezvous("127.0.0.1", free_port(), 2, "ctl-silent", timeout_s=10)
    store = open_store(rdv, is_master=True)
    channel = StoreChannel(store, Keys(rdv.name), ["http://engine0"], timeout_s=0.5, secret=SECRET)
    with pytest.raises(SyncError, match="no answer under .* within 0.5s"):
        channel.begin(_req(1))


def test_only_signed_values_are_served() -> None:
    rdv = Rendezvous("127.0.0.1", free_port(), 2, "ctl-signed", timeout_s=10)
    store = open_store(rdv, is_master=True)
    engine = _Engine()
    listener = StoreListener(rdv, 0, engine.begin, secret="a-secret-of-the-sync-0123")
    listener.start()
    try:
        keys = Keys(rdv.name)
        store.set(keys.begin(1), _req(7).model_dump_json())  # a stranger's unsigned begin
        forged = StoreChannel(store, keys, ["http://engine0"], timeout_s=1, secret="another-secret-000000")
        with pytest.raises(SyncError, match="no answer"):
            forged.begin(_req(8))  # signed with the wrong secret: dropped too
        assert engine.seen == []
        channel = StoreChannel(store, keys, ["http://engine0"], timeout_s=10, secret="a-secret-of-the-sync-0123")
        channel.begin(_req(9))
        assert channel.finish(9)[0].version == 9 and engine.seen == [9]
    finally:
        listener.stop()


def test_the_sync_store_listens_only_on_its_host() -> None:
    rdv = Rendezvous("127.0.0.1", free_port(), 2, "bound", timeout_s=10)
    store = open_store(rdv, is_master=True)
    assert listening([rdv.port]) == {rdv.port: ["0100007F"]}  # 127.0.0.1, not 0.0.0.0 or ::
    del store
