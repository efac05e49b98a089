"""Whether the engine ranks of a sync are still there: each beats a counter in the sync's store
from its own thread and connection (``Heartbeat``), and trainer rank 0, while it waits for an
engine's answer, reads the counters (``Watch``): a killed process or a lost host is named
within ``SILENT_S`` instead of at the end of the wait's timeout.

The counters are plain store counters, unsigned: another local client of the store can only
keep a dead member looking alive, which delays its detection to the wait's own timeout.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence

import torch.distributed as dist

from shardsync.store.rendezvous import Rendezvous, open_store

log = logging.getLogger(__name__)

PERIOD_S = 0.25  # a beat every this often
SILENT_S = 2.0  # no beat for this long: the member is gone (8 beats missed)


class Silent(RuntimeError):
    """A member whose heartbeat stopped: its process died or its host is unreachable."""


class Heartbeat:
    """One member's beat: ``store.add(key, 1)`` every ``period_s`` on a connection of its own
    (never queued behind the member's own long waits), until ``stop`` or the store is gone."""

    def __init__(self, rdv: Rendezvous, key: str, period_s: float = PERIOD_S) -> None:
        self.key, self.period_s = key, period_s
        self._store = open_store(rdv, is_master=False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardsync-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self.key, 1)
            except Exception as e:  # the store's host is gone: so is the sync
                log.debug("heartbeat %s stops: %s", self.key, e)
                return
            if self._stop.wait(self.period_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.period_s)


class Watch:
    """Trainer rank 0's view of the members' heartbeats: ``members`` maps each heartbeat key to
    who it is (as an error names it).  A member is silent once its counter has not moved for
    ``silent_s`` of this watch's own checks.

    A watched wait blocks in the store as an unwatched one does (an answer wakes it at once: no
    polling on an update's path); the watch's own thread, on its own store connection, reads
    the counters meanwhile and, when a member falls silent, writes a marker under the awaited
    keys, which wakes the wait to raise ``Silent``."""

    def __init__(self, store: dist.Store, members: Mapping[str, str], silent_s: float = SILENT_S) -> None:
        self.store, self.members, self.silent_s = store, dict(members), silent_s
        self._seen: dict[str, tuple[int, float]] = {}
        self._checked = 0.0
        self._lock = threading.Lock()
        self._awaited: list[str] = []
        self._silenced: str | None = None
        self._thread: threading.Thread | None = None

    def check(self, store: dist.Store | None = None) -> None:
        """``Silent`` naming the first member whose counter stopped (at most one store round
        trip per member every ``PERIOD_S``), read through ``store`` (default: the watch's)."""
        now = time.monotonic()
        if now - self._checked < PERIOD_S:
            return
        self._checked = now
        for key, who in self.members.items():
            count = (store or self.store).add(key, 0)
            seen = self._seen.get(key)
            if seen is None or seen[0] != count:
                self._seen[key] = (count, now)
            elif now - seen[1] > self.silent_s:
                raise Silent(f"{who} stopped its heartbeat {now - seen[1]:.1f}s ago (its process died "
                             "or its host is unreachable)")

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta) -> None:
        """``store.wait(keys, timeout)``, ended early by a silent member (``Silent``)."""
        with self._lock:
            self._awaited, self._silenced = list(keys), None
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=_watching, args=(weakref.ref(self),),
                                                name="shardsync-watch", daemon=True)
                self._thread.start()
        try:
            self.store.wait(list(keys), timeout)
        finally:
            with self._lock:
                self._awaited, silenced = [], self._silenced
        if silenced is not None:
            raise Silent(silenced)

    def _round(self, store: dist.Store) -> None:
        """One check while a wait is on; a silent member's name wakes the wait."""
        if not self._awaited:
            return
        try:
            self.check(store)
        except Silent as e:
            with self._lock:
                if not self._awaited:
                    return
                self._silenced = str(e)
                for key in self._awaited:
                    store.set(key, SILENCED + str(e))


SILENCED = "\0shardsync-silent\0"  # what the watch writes under an awaited key: never a signed value


def _watching(ref: weakref.ReferenceType[Watch]) -> None:
    """The watch's thread, as long as its watch lives (its own connection to the store)."""
    watch = ref()
    if watch is None:
        return
    try:
        store = watch.store.clone()  # type: ignore[attr-defined]  # TCPStore.clone: missing in torch's stubs
    except Exception as e:  # a store without clone: the watch only times out
        log.debug("watch: no store connection of its own (%s)", e)
        return
    del watch
    while True:
        time.sleep(PERIOD_S)
        watch = ref()
        if watch is None:
            return
        try:
            watch._round(store)
        except Exception as e:  # the store is gone: so is the sync; waits end at their timeout
            log.debug("watch stops: %s", e)
            return
        del watch


def wait(store: dist.Store, keys: Sequence[str], timeout: datetime.timedelta, watch: Watch | None = None) -> None:
    """``store.wait(keys, timeout)``; with a ``watch`` (over this ``store``), a silent member ends
    the wait (``Silent``) long before ``timeout``.  ``DistStoreError`` at the timeout."""
    if watch is None:
        store.wait(list(keys), timeout)
    else:
        watch.wait(keys, timeout)
