"""Spawned multi-process worlds for dist tests: free ports, hard timeouts, clean exits."""

from __future__ import annotations

import os
import queue
import socket
import traceback
from collections.abc import Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A port the OS says is free now (never a fixed port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable, rank: int, args: tuple, out) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        fn(rank, *args, out)
    except BaseException:
        out.put((rank, {"__error__": traceback.format_exc()}))
        raise


def run_world(fn: Callable, nprocs: int, *, args: tuple = (), timeout: float = 120) -> dict[int, object]:
    """Run ``fn(rank, *args, out)`` in ``nprocs`` spawned processes; each puts (rank, result).

    Fails (after killing every process) if any process errors or the world outlives
    ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, out), daemon=True) for r in range(nprocs)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        while len(results) < nprocs:
            try:
                rank, res = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"world of {nprocs} timed out after {timeout}s; "
                                   f"results from ranks {sorted(results)}") from None
            if isinstance(res, dict) and "__error__" in res:
                raise RuntimeError(f"rank {rank} failed:\n{res['__error__']}")
            results[rank] = res
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return results
