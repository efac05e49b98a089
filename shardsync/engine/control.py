"""Begin/finish through the sync group's store instead of HTTP (``SyncConfig(control="store")``).

The trainer already hosts a TCPStore every engine joined at connect; a key set there reaches
the engine in a fraction of an HTTP round trip.  Per update ``n`` (counted from 1 per
connection): trainer rank 0 sets ``ctl/n/begin`` (the begin body); this engine's control
thread validates it exactly as ``POST /weights/begin`` does and answers
``ctl/n/accepted/<engine>``; after the receive it answers ``ctl/n/result/<engine>`` (the
``UpdateResult``).  Every wait is bounded; the HTTP endpoints keep working alongside.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch.distributed as dist
from pydantic import ValidationError

from shardsync.engine.protocol import BeginRequest, UpdateResult, ctl_key
from shardsync.transport.group import Rendezvous, open_store

log = logging.getLogger(__name__)

# An idle engine waits this long per wait (between updates: rollouts, training); a wait that
# times out is simply renewed.  Stopping never waits for it: ``stop`` wakes the thread.
IDLE = datetime.timedelta(hours=1)
STOP = json.dumps({"stop": True})


class StoreControl:
    """The engine's control thread for one sync connection."""

    def __init__(self, pending: dict, *, begin: Callable[[BeginRequest], dict],
                 entry: Callable[[int], tuple[str, Future]],
                 settle: Callable[[int, str, Future | BaseException], UpdateResult]) -> None:
        self.rdv = Rendezvous(**pending["rendezvous"])
        self.index = pending["engine_index"]
        self._begin, self._entry, self._settle = begin, entry, settle
        self._stop = threading.Event()
        self._seq = 1  # the next update's number on this connection
        self._thread = threading.Thread(target=self._loop, name="engine-control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Never blocks the caller: a helper thread wakes the loop through its next key (only if
        the trainer did not set it first); if the trainer's store is gone, the loop's own wait
        fails and it ends."""
        self._stop.set()
        threading.Thread(target=self._wake, name="engine-control-stop", daemon=True).start()

    def _wake(self) -> None:
        try:
            store = open_store(dataclasses.replace(self.rdv, timeout_s=5.0), is_master=False)
            store.compare_set(ctl_key(self.rdv.name, self._seq, "begin"), "", STOP)
        except Exception:
            pass

    def _loop(self) -> None:
        try:
            store = open_store(self.rdv, is_master=False)
        except Exception as e:
            log.warning("store control: cannot reach the trainer's store: %s", e)
            return
        while not self._stop.is_set():
            key = ctl_key(self.rdv.name, self._seq, "begin")
            try:
                store.wait([key], IDLE)
            except dist.DistNetworkError as e:  # the trainer is gone: nothing more will come
                log.info("store control: trainer store closed (%s)", e)
                return
            except dist.DistStoreError:  # idle for an hour: wait again (breaks nothing)
                continue
            body = json.loads(store.get(key))
            if body.get("stop"):
                return
            try:
                self._serve(store, self._seq, body)
            except Exception as e:  # the trainer times out on its side; keep serving later updates
                log.warning("store control: update %d: %s", self._seq, e)
            self._seq += 1

    def _serve(self, store: dist.Store, seq: int, body: dict) -> None:
        name = self.rdv.name
        try:
            self._begin(BeginRequest(**body))
        except ValidationError as e:
            store.set(ctl_key(name, seq, "accepted", self.index), json.dumps({"error": f"422: {e}"}))
            return
        except Exception as e:  # ApiError: the same refusal HTTP would give, weights untouched
            status = getattr(e, "status", 500)
            store.set(ctl_key(name, seq, "accepted", self.index), json.dumps({"error": f"{status}: {e}"}))
            return
        store.set(ctl_key(name, seq, "accepted", self.index), json.dumps({"ok": True}))
        mode, fut = self._entry(body["version"])
        try:
            fut.result(timeout=4 * self.rdv.timeout_s + 60)  # the receive itself waits under the timeout
            outcome: Future | BaseException = fut
        except Exception as e:
            outcome = e
        res = self._settle(body["version"], mode, outcome)
        store.set(ctl_key(name, seq, "result", self.index), res.model_dump_json())
