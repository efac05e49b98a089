"""``shardsync demo --engine vllm``: the GRPO loop with a real vLLM server as the rollout
engine, synced by p2p and broadcast after every step, ends with every checksum ok."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_with_vllm_runs_to_the_end(tmp_path) -> None:
    out = tmp_path / "demo"
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "demo", "--engine", "vllm", "--steps", "2",
                        "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bitwise checksum after every sync: ok" in r.stdout
    steps = json.loads((out / "steps.json").read_text())["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for s in steps:
        assert set(s["updates"]) == {"p2p", "broadcast"}
        for u in s["updates"].values():
            assert u["checksum_ok"] is True
            assert u["logprob_abs_diff"] < 1e-4  # vLLM scores the batch as the trainer does (float32)
    assert any(s["grad_norm"] > 0 for s in steps)  # rollouts differ within a group: GRPO learns
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {e["destination"] for rec in records for e in rec["engines"]} == {"loader"}
