"""Sealed store values (``store/sealed.py``) read over a real ``TCPStore``: a value deleted by
another client between the wait and the read (the store then answers empty) is no answer yet,
waited for within the same bound, never an unsigned value."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from shardsync.control.wire import Accepted
from shardsync.store.rendezvous import free_port
from shardsync.store.sealed import get, put

SECRET = "a-test-secret-0123456789"


class DeletedOnFirstRead:
    """Stand-in for the race: the real store, whose first read of a key comes back empty, as a
    read does when another client deleted the key after the wait saw it."""

    def __init__(self, store: dist.TCPStore) -> None:
        self.store, self.reads = store, 0

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self.store.wait(keys, timeout)

    def get(self, key: str) -> bytes:
        self.reads += 1
        return b"" if self.reads == 1 else self.store.get(key)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), None, True, timeout=datetime.timedelta(seconds=5),
                         wait_for_workers=False)


def test_an_empty_read_is_waited_past() -> None:
    store = _store()
    put(store, "k", Accepted(ok=True), SECRET)
    racy = DeletedOnFirstRead(store)
    assert get(racy, "k", Accepted, datetime.timedelta(seconds=2), SECRET).ok  # type: ignore[arg-type]
    assert racy.reads == 2


def test_a_value_deleted_until_the_bound_ends_as_no_answer() -> None:
    store = _store()
    put(store, "k", Accepted(ok=True), SECRET)

    class AlwaysDeleted(DeletedOnFirstRead):
        def get(self, key: str) -> bytes:
            return b""

    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="deleted as it was read"):
        get(AlwaysDeleted(store), "k", Accepted, datetime.timedelta(seconds=0.3), SECRET)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 5


def test_junk_is_still_refused() -> None:
    store = _store()
    store.set("k", '{"ok": true}')
    with pytest.raises(ValueError, match="is not signed"):
        get(store, "k", Accepted, datetime.timedelta(seconds=1), SECRET)
