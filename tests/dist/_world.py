"""Spawned multi-process worlds for dist tests: free ports, hard timeouts, clean exits."""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable

import torch

from shardsync.launch.procs import start_all, worker_context
from shardsync.store.rendezvous import free_port

# megatron-core's import takes seconds per process: the reference tests' ranks find it loaded
PRELOAD = ("megatron.core.parallel_state", "megatron.core.models.gpt")




class _Out:
    """What ``fn`` gets as ``out``: ``put((rank, result))`` ships the result as bytes
    (``torch.save``), so tensors survive their process exiting first."""

    def __init__(self, queue) -> None:
        self._queue = queue

    def put(self, item: tuple[int, object]) -> None:
        import torch

        buf = io.BytesIO()
        torch.save(item[1], buf)
        self._queue.put((item[0], buf.getvalue()))


def _entry(fn: Callable, rank: int, args: tuple, queue) -> None:
    import torch

    torch.set_num_threads(1)
    out = _Out(queue)
    try:
        fn(rank, *args, out)
    except BaseException:
        out.put((rank, {"__error__": traceback.format_exc()}))
        raise


def run_world(fn: Callable, nprocs: int, *, args: tuple = (), timeout: float = 120) -> dict[int, object]:
    """Run ``fn(rank, *args, out)`` in ``nprocs`` fresh processes; each puts (rank, result).

    Processes come from a forkserver that imported torch once (spawn semantics, no
    inherited threads or groups).  Fails, after killing every process, if a process
    errors, dies without a result, or the world outlives ``timeout`` seconds in total.
    Results should be plain Python (tensors as ``torch.save`` bytes).
    """
    ctx = worker_context(PRELOAD)
    out = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, out), daemon=True) for r in range(nprocs)]
    start_all(procs, threads=1)
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < nprocs:
            try:
                rank, res = out.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"ranks {dead} died without a result "
                                       f"(exit codes {[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"world of {nprocs} timed out after {timeout}s; "
                                       f"results from ranks {sorted(results)}") from None
                continue
            res = torch.load(io.BytesIO(res), weights_only=False)
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


def join_trainer(rank: int, world: int, port: int, spec, par, *, seed: int, timeout_s: float = 60.0):
    """In a spawned rank: join the trainer's default group (gloo, one torch thread) and load
    this rank's share of ``spec``'s random weights in ``par``'s Megatron layout.

    Returns (trainer layout, local tensors by name)."""
    import datetime

    import torch.distributed as dist

    from shardsync.models.weights import load_rank, random_source
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    layout = Topology(spec, par).trainer_layout
    return layout, load_rank(layout, rank, random_source(spec, seed=seed))
