"""The engine's command order: weight commands go ahead of queued serving, and every result
carries the version it ran on.  The worker is a stand-in (no model): the dispatcher only
calls ``handle``."""

from __future__ import annotations

import threading

from shardsync.control.session import UpdateSession
from shardsync.engine.dispatch import Dispatcher


class _FakeWorker:
    """Stands in for EngineWorker: records the order of commands; generation is slow."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()
        self.running = threading.Event()

    def handle(self, kind: str, args: dict):
        if kind == "generate":
            self.running.set()
            self.gate.wait(10)
            self.order.append(f"generate{args['i']}")
            return [([1], [0.0])]
        self.order.append(kind)
        return {"ok": True, "pack_s": 0.0, "transfer_s": 0.0, "unpack_s": 0.0, "total_s": 0.0,
                "bytes_received": 0, "changed": 0, "buffer_bytes": 0, "buckets": 0, "destination": "params"}


def test_an_update_goes_ahead_of_queued_generation_and_results_say_their_version() -> None:
    worker, session = _FakeWorker(), UpdateSession()
    session.fingerprints = {"p2p": "f", "broadcast": "g"}
    d = Dispatcher(worker, [], None, session)
    d.start()
    futures = [d.submit("generate", {"i": i}) for i in range(3)]
    assert worker.running.wait(10)  # generate0 is running (blocked on the gate); 1 and 2 wait queued
    from shardsync.control.wire import BeginRequest

    session.begin(BeginRequest(version=5, mode="p2p", fingerprint="f"))
    update = d.command("update", {"version": 5, "mode": "p2p"})
    worker.gate.set()
    result, version = update.future.result(10)
    assert update.started.done() and result.ok and version == 5
    versions = [f.result(10)[1] for f in futures]
    assert worker.order == ["generate0", "update", "generate1", "generate2"]
    assert versions == [0, 5, 5], "a request overtaken by the update ran on, and reports, version 5"
    d.stop()
