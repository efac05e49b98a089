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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from shardsync.store.rendezvous import Rendezvous, open_store

log = logging.getLogger(__name__)

PERIOD_S = 0.25  # a beat every this often
SILENT_S = 2.0  # no beat for this long: the member is gone (8 beats missed)
# a wait polls (a timed-out store wait logs a warning each time): first quickly, then at most this often
POLL_MAX_S = 0.002


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


@dataclass
class Watch:
    """Trainer rank 0's view of the members' heartbeats: ``members`` maps each heartbeat key to
    who it is (as an error names it).  A member is silent once its counter has not moved for
    ``silent_s`` of this watch's own checks."""

    store: dist.Store
    members: Mapping[str, str]
    silent_s: float = SILENT_S
    _seen: dict[str, tuple[int, float]] = field(default_factory=dict, repr=False)
    _checked: float = field(default=0.0, repr=False)

    def check(self) -> None:
        """``Silent`` naming the first member whose counter stopped (at most one store round
        trip per member every ``PERIOD_S``)."""
        now = time.monotonic()
        if now - self._checked < PERIOD_S:
            return
        self._checked = now
        for key, who in self.members.items():
            count = self.store.add(key, 0)
            seen = self._seen.get(key)
            if seen is None or seen[0] != count:
                self._seen[key] = (count, now)
            elif now - seen[1] > self.silent_s:
                raise Silent(f"{who} stopped its heartbeat {now - seen[1]:.1f}s ago (its process died "
                             "or its host is unreachable)")


def wait(store: dist.Store, keys: Sequence[str], timeout: datetime.timedelta, watch: Watch | None = None) -> None:
    """``store.wait(keys, timeout)``; with a ``watch``, polled, so a silent member ends the wait
    (``Silent``) long before ``timeout``.  ``DistStoreError`` at the timeout, as the store's."""
    if watch is None:
        store.wait(list(keys), timeout)
        return
    deadline = time.monotonic() + timeout.total_seconds()
    pause = 5e-5
    while not store.check(list(keys)):
        watch.check()
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds():g}s, keys: {list(keys)}")
        time.sleep(pause)
        pause = min(2 * pause, POLL_MAX_S)
