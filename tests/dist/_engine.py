"""A real engine server as a subprocess (``shardsync engine serve``) for dist tests."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx

from tests.dist._world import free_port


def start_engine(model: str, tp: int, *, seed: int = 0, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # A file, not a pipe: nobody reads a pipe while the test runs, and a full pipe blocks
    # the engine on its next log line.
    log = tempfile.NamedTemporaryFile(prefix="shardsync-engine-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "shardsync.cli", "engine", "serve", "--model", model,
                             "--tp", str(tp), "--port", str(port), "--seed", str(seed), *extra],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited: {open(log.name).read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("engine did not come up in 90 s")


def stop_engine(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
