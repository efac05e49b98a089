"""Worker processes: started the same way everywhere (few torch threads each), and what of
them is left afterwards."""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable, Iterable
from pathlib import Path

PRELOAD = ("torch", "shardsync.paths", "shardsync.sync")  # what a sync rank imports anyway


def worker_context(extra: tuple[str, ...] = ()):  # -> torch.multiprocessing's forkserver context
    """Processes with spawn's semantics (no inherited threads, groups or CUDA) that start with
    torch and shardsync imported: a forkserver imports them once, instead of every rank again
    (seconds of CPU per rank).  ``extra``: more modules its ranks import (megatron-core's take
    seconds); what the first call in a process names is what its forkserver holds."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *extra])
    return ctx


def start_all(procs: Iterable, *, threads: int = 1) -> None:
    """Start ``procs`` with ``OMP_NUM_THREADS=threads`` in their environment.

    Children read it when torch initializes; the parent's own setting is restored, so a
    2-core machine is not oversubscribed by N processes of N threads each.
    """
    old = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        for p in procs:
            p.start()
    finally:
        if old is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = old


def run_ranks(target: Callable, world: int, args: tuple, *, timeout_s: float = 3600.0,
              threads: int = 1) -> dict:
    """Spawn ``target(rank, *args, out)`` for ``world`` ranks; each puts ``(rank, result)`` on
    ``out``.  Returns the results by rank; a rank that exits without one, or a world that
    outlives ``timeout_s``, fails the run at once (every process killed)."""
    ctx = worker_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world)]
    start_all(procs, threads=threads)
    results: dict = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            try:
                rank, value = out.get(timeout=1.0)
                results[rank] = value
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead:
                raise RuntimeError(f"rank(s) {dead} exited with {[procs[r].exitcode for r in dead]} "
                                   "before handing in a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} gave no result "
                                   f"within {timeout_s:g}s")
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return results


# -- what is left of a run (Linux /proc; leak checks of tests and the soak benchmark) --

def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def children(pid: int) -> list[int]:
    """Live processes whose parent is ``pid`` (multiprocessing's resource tracker left out)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"resource_tracker" not in cmdline:
            out.append(int(stat.parent.name))
    return sorted(out)


def _listeners() -> list[tuple[str, int]]:
    """(local address in hex, as /proc shows it; port) of every listening TCP socket here."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                addr, port = fields[1].rsplit(":", 1)
                out.append((addr, int(port, 16)))
    return out


def listening_ports() -> set[int]:
    """Every TCP port something on this machine listens on (a run's leak check: after - before)."""
    return {port for _, port in _listeners()}


def listening(ports: Iterable[int]) -> dict[int, list[str]]:
    """For each of ``ports`` something listens on: the local addresses (hex, as /proc shows)."""
    wanted, found = set(ports), dict[int, list[str]]()
    for addr, port in _listeners():
        if port in wanted:
            found.setdefault(port, []).append(addr)
    return found
