"""Every benchmark under ``benchmarks/`` is code and is run small, so none rots: each
script's ``--help`` (its imports and argument parsing), and a tiny CPU run of every one that
can run on a CPU, checked for a clean exit and the JSON it writes.  The GPU-only scripts
(``gpu_update``, ``peers_gpu``, ``gather_kernel``, ``ipc_contexts``, ``fp8_matmul``) and ``vllm_update``
(a vLLM virtualenv) get ``--help`` here; their calls into each other and into shardsync are
checked by the type checker (``mypy benchmarks``, ``.ci/run``).  Its own CI step
(``pytest -q -m bench``): a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py")) + ["hop_trace/analyze.py"]

# script -> a tiny CPU run's arguments (``--out`` is added)
TINY: dict[str, list[str]] = {
    "control_plane.py": ["--updates", "2"],
    "group_proof.py": ["--ranks", "2", "--repeat", "1"],
    "plan_build.py": ["--repeat", "1"],
    "sync_modes.py": ["--model", "tiny-qwen3", "--updates", "1", "--warmup", "0", "--trainer-tp", "1",
                      "--engine-tp", "1"],
    "wire_check.py": ["--model", "tiny-qwen3", "--updates", "1", "--warmup", "0", "--trainer-tp", "1",
                      "--engine-tp", "1"],
    "topologies.py": ["--only", "tp2-tp1", "--updates", "1", "--warmup", "0"],
    "pause.py": ["--kinds", "in-place", "--updates", "1", "--idle-s", "0.3", "--gap-s", "0.1",
                 "--clients", "1", "--max-new-tokens", "2"],
    "delta.py": ["--lrs", "1e-5", "--steps", "1", "--transports", "disk", "--skip-e2e"],
    "fp8_delta.py": ["--steps", "1", "--trainer-tp", "1", "--engine-tp", "1"],
    "lora_update.py": ["--model", "tiny-qwen3", "--rank", "4", "--updates", "1", "--warmup", "0", "--trainer-tp", "1",
                       "--engine-tp", "1"],
    "engine_forward.py": ["--tp", "1", "--layers", "1", "--prefill-len", "8", "--prompt-len", "4",
                          "--new-tokens", "2", "--rounds", "1", "--repeat", "1"],
}
# measured on a GPU or inside another virtualenv: --help and the type checker only
NO_CPU_RUN = {"gpu_update.py", "peers_gpu.py", "gather_kernel.py", "ipc_contexts.py", "fp8_matmul.py", "vllm_update.py",
              "soak.py", "hop_trace/analyze.py", "hop_trace/sitecustomize.py"}


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(BENCH))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


def test_every_script_is_covered() -> None:
    """A new benchmark gets a tiny run here or says why it has none."""
    missing = [s for s in SCRIPTS if s not in TINY and s not in NO_CPU_RUN]
    assert not missing, f"benchmarks without a smoke run: {missing}; add them to TINY or NO_CPU_RUN"


@pytest.mark.bench
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s != "hop_trace/sitecustomize.py"])
def test_help(script: str) -> None:
    r = _run([str(BENCH / script), "--help"], timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "usage:" in r.stdout


@pytest.mark.bench
@pytest.mark.parametrize("script", sorted(TINY))
def test_tiny_cpu_run(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    r = _run([str(BENCH / script), *TINY[script], "--out", str(out)], timeout=600)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert json.loads(out.read_text()), f"{script} wrote an empty result"
