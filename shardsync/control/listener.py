"""The engine's store listener: begin/finish through the sync group's store instead of HTTP
(``control="store"``).

The trainer already hosts a TCPStore every engine joined at connect; a key set there reaches
the engine in a fraction of an HTTP round trip.  Per update ``n`` (counted from 1 per
connection): trainer rank 0 sets ``Keys.begin(n)`` (a ``BeginRequest``); this listener hands
it to the engine's ``begin`` (the same validation HTTP begin runs) and answers
``Keys.accepted(n, engine)``; after the receive it answers ``Keys.result(n, engine)`` (the
``UpdateResult``).  Every value is validated JSON; every wait is bounded.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import threading
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

import torch.distributed as dist
from pydantic import ValidationError

from shardsync.control.wire import Accepted, BeginRequest, Stop
from shardsync.runtime.ledger import UpdateResult
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.store.sealed import put, seal, unseal

log = logging.getLogger(__name__)

# An idle engine waits this long per wait (between updates: rollouts, training); a wait that
# times out is simply renewed.  Stopping never waits for it: ``stop`` wakes the thread.
IDLE = datetime.timedelta(hours=1)


class StoreListener:
    """One thread per sync connection.  ``begin`` validates and queues an update, returning
    (started, result) futures: the update is accepted once the engine is ready to receive it,
    so the trainer's transfer timeouts start only then (or raises the refusal)."""

    def __init__(self, rdv: Rendezvous, engine_index: int,
                 begin: Callable[[BeginRequest], tuple[Future, Future]], secret: str, *,
                 refuse: Callable[[BeginRequest], Future] | None = None) -> None:
        """``refuse``: answers a refused pipelined begin through the transport."""
        self.rdv, self.index, self._begin, self.secret = rdv, engine_index, begin, secret
        self._refuse = refuse
        self.keys = Keys(rdv.name)
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
            key = self.keys.begin(self._seq)
            store.compare_set(key, "", seal(key, Stop().model_dump_json(), self.secret))
        except Exception:
            pass

    def _loop(self) -> None:
        try:
            store = open_store(self.rdv, is_master=False)
        except Exception as e:
            log.warning("store control: cannot reach the trainer's store: %s", e)
            return
        while not self._stop.is_set():
            key = self.keys.begin(self._seq)
            try:
                store.wait([key], IDLE)
            except dist.DistNetworkError as e:  # the trainer is gone: nothing more will come
                log.info("store control: trainer store closed (%s)", e)
                return
            except dist.DistStoreError:  # idle for an hour: wait again (breaks nothing)
                continue
            try:
                raw = unseal(key, store.get(key), self.secret)
            except ValueError as e:  # not from the trainer: drop it, wait for the real one
                log.warning("store control: %s", e)
                store.delete_key(key)
                continue
            if _is_stop(raw):
                return
            try:
                self._serve(store, self._seq, raw)
            except Exception as e:  # the trainer times out on its side; keep serving later updates
                log.warning("store control: update %d: %s", self._seq, e)
            self._seq += 1

    def _serve(self, store: dist.Store, seq: int, raw: bytes | str) -> None:
        """A pipelined begin's answer is read with its result: this thread then sleeps until
        the update ended instead of waking (and taking the GIL) while the receive starts."""
        accepted = self.keys.accepted(seq, self.index)
        wait_s = 4 * self.rdv.timeout_s + 60
        try:
            req = BeginRequest.model_validate_json(raw)
            started, fut = self._begin(req)
            if req.pipelined:
                futures.wait([fut], timeout=wait_s)
            started.result(timeout=wait_s)
        except ValidationError as e:
            put(store, accepted, Accepted(error=f"invalid begin: {e}"), self.secret)
            return
        except Exception as e:  # a session refusal: the same HTTP begin gives, weights untouched
            if req.pipelined and self._refuse is not None:  # the trainer's signal is on its way
                try:
                    self._refuse(req).result(timeout=wait_s)
                except Exception as answer:
                    log.warning("store control: update %d: answering the refusal failed: %s", seq, answer)
            put(store, accepted, Accepted(error=str(e)), self.secret)
            return
        put(store, accepted, Accepted(ok=True), self.secret)
        try:  # the receive itself waits under the group timeout
            res: UpdateResult = fut.result(timeout=wait_s)
        except Exception as e:
            res = UpdateResult(version=req.version, mode=req.mode, ok=False,
                               error=f"{type(e).__name__}: {e}")
        put(store, self.keys.result(seq, self.index), res, self.secret)


def _is_stop(raw: bytes | str) -> bool:
    if not (b'"stop"' in raw if isinstance(raw, bytes) else '"stop"' in raw):
        return False  # a begin request (parsing it here would cost the update's start ~30 us)
    try:
        return bool(json.loads(raw).get("stop"))
    except (ValueError, AttributeError):
        return False
