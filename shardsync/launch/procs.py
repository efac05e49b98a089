"""Starting worker processes the same way everywhere: few torch threads each."""

from __future__ import annotations

import os
from collections.abc import Iterable


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
