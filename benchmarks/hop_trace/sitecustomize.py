"""Where one update's time goes, hop by hop, across the trainer and engine processes.

With this folder on ``PYTHONPATH`` and ``SHARDSYNC_TRACE`` set to a directory, every Python
process that starts (the trainer and the engine server it spawns) wraps the functions in
``HOPS`` and records entry and exit on ``time.monotonic_ns`` (one clock for every process
of the machine); each process appends its records to ``<dir>/<pid>.jsonl`` after each
update.  ``analyze.py`` lines them up per update.  A wrapper costs ~2 us per call: the
figures are attribution, not the update's own time (measure that without the trace).

    PYTHONPATH=benchmarks/hop_trace:$PWD SHARDSYNC_TRACE=/tmp/hops \\
        python benchmarks/gpu_update.py --model Qwen3-4B --runs map:store --no-kernels
    python benchmarks/hop_trace/analyze.py /tmp/hops
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import threading
import time

COLOCATED = "shardsync.transport.colocated"
MAP_SENDER, MAP_RECEIVER = f"{COLOCATED}.map_sender", f"{COLOCATED}.map_receiver"
PUSH_SENDER, PUSH_RECEIVER = f"{COLOCATED}.push_sender", f"{COLOCATED}.push_receiver"
EXPORTS, LINK = f"{COLOCATED}.exports", f"{COLOCATED}.link"
HOPS = [  # (module, class.function): the trainer's side, then the engine's, in call order
    ("shardsync.sync", "WeightSync.update"), ("shardsync.sync", "WeightSync._begin"),
    ("shardsync.sync", "WeightSync._finish"),
    ("shardsync.control.client", "StoreChannel.begin"), ("shardsync.control.client", "StoreChannel.finish"),
    (MAP_SENDER, "MapSender.run"), (EXPORTS, "Exports.stale"), (EXPORTS, "Exports.moved"),
    (EXPORTS, "Exports.mark_written"), (LINK, "TrainerLink.signal"),
    ("shardsync.control.listener", "StoreListener._serve"), ("shardsync.engine.updates", "WeightService.begin"),
    ("shardsync.control.session", "UpdateSession.begin"), ("shardsync.engine.dispatch", "Dispatcher.command"),
    ("shardsync.engine.dispatch", "Dispatcher._accept"), ("shardsync.engine.dispatch", "Dispatcher._apply"),
    ("shardsync.engine.dispatch", "Dispatcher._finish"), ("shardsync.engine.fanout", "FanOut.run"),
    ("shardsync.engine.worker", "EngineWorker.handle"), ("shardsync.receiver.receiver", "Receiver.receive"),
    (MAP_RECEIVER, "MapReceiver.run"), (LINK, "EngineLink.header"), (MAP_RECEIVER, "MapReceiver._compiled"),
    (MAP_RECEIVER, "MapReceiver._after_writes"), ("shardsync.transport.copies", "Copies.run"),
    ("shardsync.transport.gather", "Gather.run"), (MAP_RECEIVER, "MapReceiver._complete"),
    (LINK, "EngineLink.answer"),
    # push (a staged engine): the trainer's copies, the engine's stage thread and its commit
    (PUSH_SENDER, "PushSender.launch"), (PUSH_SENDER, "PushSender._export_moved"),
    (PUSH_SENDER, "PushSender.run"), (PUSH_SENDER, "PushSender._copy"), (LINK, "TrainerLink.staged"),
    (PUSH_RECEIVER, "PushReceiver.run"), (PUSH_RECEIVER, "PushReceiver.committed"),
    ("shardsync.engine.worker", "EngineWorker.stage"), ("shardsync.engine.worker", "EngineWorker.update"),
    ("shardsync.engine.dispatch", "Dispatcher._on_staged"), ("shardsync.engine.worker", "EngineWorker.commit"),
    ("shardsync.receiver.destination", "Staged.commit"), ("shardsync.receiver.destination", "Staged.prepare"),
]
FLUSH = {"WeightSync.update", "StoreListener._serve"}  # one update ended in this process
MODULE_FUNCTIONS = [("shardsync.control.listener", "put", "shardsync.store.sealed"),
                    ("shardsync.control.listener", "unseal", "shardsync.store.sealed")]
_records: list = []


def _dump(folder: str) -> None:
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        for r in _records:
            f.write(json.dumps(r) + "\n")
    _records.clear()


def _wrap(fn, label: str, folder: str):
    @functools.wraps(fn)
    def traced(*args, **kwargs):
        _records.append((label, "in", time.monotonic_ns(), threading.current_thread().name))
        try:
            return fn(*args, **kwargs)
        finally:
            _records.append((label, "out", time.monotonic_ns(), threading.current_thread().name))
            if label in FLUSH:
                _dump(folder)
    return traced


def _install(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    for module, qualname in HOPS:
        owner, name = qualname.split(".")
        cls = getattr(importlib.import_module(module), owner)
        setattr(cls, name, _wrap(getattr(cls, name), qualname, folder))
    for user, name, origin in MODULE_FUNCTIONS:  # names a module imported from another one
        setattr(importlib.import_module(user), name,
                _wrap(getattr(importlib.import_module(origin), name), name, folder))


if os.environ.get("SHARDSYNC_TRACE"):
    _install(os.environ["SHARDSYNC_TRACE"])
