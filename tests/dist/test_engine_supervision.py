"""A reference engine never hangs half-alive: a dead TP worker stops the whole engine, and a
killed launcher takes its workers with it (no orphan keeps serving)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from shardsync.launch.procs import alive, children
from tests.dist._engine import start_engine, stop_engine


def _until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return cond()


def test_a_dead_tp_worker_stops_the_engine() -> None:
    proc, url = start_engine("tiny-qwen3", 2)
    try:
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)  # TP worker 1 (spawned second)
        assert _until(lambda: proc.poll() is not None, 30), "the engine kept running without a worker"
        assert proc.returncode != 0
        assert not any(alive(w) for w in workers)
        try:
            httpx.get(url + "/health", timeout=2)
            answered = True
        except httpx.HTTPError:
            answered = False
        assert not answered, "a stopped engine still answers"
    finally:
        stop_engine(proc)


def test_workers_die_with_a_killed_launcher() -> None:
    proc, _ = start_engine("tiny-qwen3", 2)
    try:
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert _until(lambda: not any(alive(w) for w in workers), 15), "orphaned TP workers kept running"
    finally:
        stop_engine(proc)
