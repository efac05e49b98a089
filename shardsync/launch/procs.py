"""Worker processes: started the same way everywhere (few torch threads each), and what of
them is left afterwards."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


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


def listening(ports: Iterable[int]) -> dict[int, list[str]]:
    """For each of ``ports`` something listens on: the local addresses (hex, as /proc shows)."""
    wanted, found = set(ports), {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, port = fields[1].rsplit(":", 1)
            if fields[3] == "0A" and int(port, 16) in wanted:
                found.setdefault(int(port, 16), []).append(addr)
    return found
