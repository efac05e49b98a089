"""Heartbeats and the watch over them (``store/liveness.py``) on a real TCPStore in this
process: a member that stops beating is named within its silence bound, never one that beats,
and a watched wait ends early on it (or returns on its key, or times out as the store's)."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from shardsync.store.liveness import Heartbeat, Silent, Watch, wait
from shardsync.store.rendezvous import Rendezvous, free_port, open_store


@pytest.fixture
def rdv_store():
    rdv = Rendezvous("127.0.0.1", free_port(), 1, "liveness", timeout_s=5)
    store = open_store(rdv, is_master=True)
    yield rdv, store
    del store


def test_a_heartbeat_beats_until_stopped(rdv_store) -> None:
    rdv, store = rdv_store
    beat = Heartbeat(rdv, "alive/0/0", period_s=0.05)
    time.sleep(0.4)
    beat.stop()
    count = store.add("alive/0/0", 0)
    assert count >= 4, count  # ~8 expected; the bound leaves room for a loaded machine
    time.sleep(0.2)
    assert store.add("alive/0/0", 0) == count, "a stopped heartbeat beats no more"


def test_the_watch_names_the_silent_member_only(rdv_store) -> None:
    rdv, store = rdv_store
    live, dying = Heartbeat(rdv, "alive/0/0", period_s=0.05), Heartbeat(rdv, "alive/1/0", period_s=0.05)
    watch = Watch(store, {"alive/0/0": "engine A", "alive/1/0": "engine B"}, silent_s=0.6)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # both beat: never silent
            watch.check()
            time.sleep(0.05)
        dying.stop()
        t0 = time.monotonic()
        with pytest.raises(Silent, match="engine B stopped its heartbeat"):
            while time.monotonic() - t0 < 5:
                watch.check()
                time.sleep(0.05)
        assert time.monotonic() - t0 < 0.6 + 0.5 + 0.5, "named within the silence bound (+ a check period)"
    finally:
        live.stop()
        dying.stop()


def test_a_watched_wait_returns_ends_early_or_times_out(rdv_store) -> None:
    rdv, store = rdv_store
    beat = Heartbeat(rdv, "alive/0/0", period_s=0.05)
    watch = Watch(store, {"alive/0/0": "engine A"}, silent_s=0.6)
    try:
        store.set("answer", b"x")
        wait(store, ["answer"], datetime.timedelta(seconds=2), watch)  # there: returns at once
        t0 = time.monotonic()
        with pytest.raises(dist.DistStoreError):  # alive but silent on the key: the timeout
            wait(store, ["never"], datetime.timedelta(seconds=1), watch)
        assert 0.9 < time.monotonic() - t0 < 3
        beat.stop()
        t0 = time.monotonic()
        with pytest.raises(Silent, match="engine A"):
            wait(store, ["never"], datetime.timedelta(seconds=30), watch)
        assert time.monotonic() - t0 < 2.0, "the member's silence ends the wait, not its 30 s timeout"
    finally:
        beat.stop()
