"""A real engine server as a subprocess (``shardsync engine serve``) for dist tests."""

from __future__ import annotations

import subprocess
import tempfile

from shardsync.control.client import wait_healthy

from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.store.secret import load_secret
from tests.dist._world import free_port


def owner() -> dict[str, str]:
    """The headers of a state-changing call by this user (an engine started without a given
    secret takes this user's own, ``store/secret.py``)."""
    return {"Authorization": f"Bearer {load_secret().value}"}


def start_engine(model: str, tp: int, *, seed: int = 0, **fields) -> tuple[subprocess.Popen, str]:
    """``fields``: more ``EngineConfig`` fields (dtype, device, ...).  Port 0: the launcher binds
    the port and hands the server its socket, so tests side by side never race for one."""
    # A file, not a pipe: nobody reads a pipe while the test runs, and a full pipe blocks the
    # engine on its next log line.
    log = tempfile.NamedTemporaryFile(prefix="shardsync-engine-", suffix=".log", delete=False)
    proc, url = spawn_server(EngineConfig(model=model, tp=tp, seed=seed, port=0, **fields),
                             stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name
    try:
        wait_healthy(url, proc, 90)
        return proc, url
    except (RuntimeError, TimeoutError) as e:
        proc.kill()
        raise RuntimeError(f"{e}: {open(log.name).read()[-2000:]}") from None


def shard_bytes(model: str, tp: int, dtype: str | None = None) -> int:
    """Bytes of TP rank 0's shard of the reference engine (a staging window is a share of it)."""
    from shardsync.layout import EngineParallel, engine_layout
    from shardsync.plan.plan import dtype_itemsize
    from shardsync.presets import load_spec

    spec = load_spec(model, dtype=dtype)
    lay = engine_layout(spec, EngineParallel(tp=tp, dtype=spec.dtype))
    return sum(t.numel for t in lay.ranks[0].tensors) * dtype_itemsize(spec.dtype)


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
