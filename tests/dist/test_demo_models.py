"""``shardsync demo`` on the newer families (mixture of experts, GLM4 dense, latent attention).
Mixture of experts: GRPO with the trainer's experts spread over its DP ranks (EP 2) into an
engine holding them EP 2 inside its TP group, synced by p2p and by broadcast, every update
checked bitwise and by the engine re-scoring the batch."""

from __future__ import annotations

import json
import subprocess
import sys


def test_moe_demo_p2p_and_broadcast_bitwise(tmp_path) -> None:
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--model", "tiny-qwen3-moe", "--trainer-tp", "1",
           "--trainer-dp", "2", "--trainer-ep", "2", "--engine-tp", "2", "--engine-ep", "2", "--steps", "2",
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "trainer TP1 PP1 DP2 EP2 ETP1 -> engines TP [2] EP2" in r.stdout
    assert "bitwise checksum after every sync: ok" in r.stdout
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    for row in rows:
        for mode in ("p2p", "broadcast"):
            u = row["updates"][mode]
            assert u["path"] == mode and u["checksum_ok"] is True
            assert u["logprob_abs_diff"] < 1e-4  # the engine scores the batch as the trainer does
    # p2p sends each engine rank only its experts: its busiest link carries less than broadcast's
    assert rows[0]["updates"]["p2p"]["busiest_link_bytes"] < rows[0]["updates"]["broadcast"]["busiest_link_bytes"]


def test_glm4_demo_p2p_and_broadcast_bitwise(tmp_path) -> None:
    """GLM4 dense: post norms, fused gate_up in the checkpoint, partial interleaved rotary."""
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--model", "tiny-glm4", "--steps", "2",
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bitwise checksum after every sync: ok" in r.stdout
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert all(row["updates"][m]["checksum_ok"] and row["updates"][m]["logprob_abs_diff"] < 1e-4
               for row in rows for m in ("p2p", "broadcast"))


def test_fsdp2_demo_bitwise(tmp_path) -> None:
    """A transformers model under FSDP2 fully_shard (2 ranks, each its own rollouts) -> engine TP 2."""
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--trainer", "fsdp2", "--trainer-dp", "2", "--engine-tp", "2",
           "--steps", "2", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "trainer FSDP2 shard 2 -> engines TP [2]" in r.stdout
    assert "bitwise checksum after every sync: ok" in r.stdout
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert all(row["updates"][m]["checksum_ok"] and row["updates"][m]["logprob_abs_diff"] < 1e-4
               for row in rows for m in ("p2p", "broadcast"))
    assert rows[0]["grad_norm"] > 0


def test_deepseek_demo_p2p_and_broadcast_bitwise(tmp_path) -> None:
    """Latent attention: the issue's topology, trainer TP 2 EP 2 -> engine TP 2 EP 2."""
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--model", "tiny-deepseek-v3", "--trainer-tp", "2",
           "--trainer-ep", "2", "--trainer-etp", "1", "--engine-tp", "2", "--engine-ep", "2", "--steps", "2",
           "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "trainer TP2 PP1 DP1 EP2 ETP1 -> engines TP [2] EP2" in r.stdout
    assert "bitwise checksum after every sync: ok" in r.stdout
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    for row in rows:
        for mode in ("p2p", "broadcast"):
            u = row["updates"][mode]
            assert u["path"] == mode and u["checksum_ok"] is True and u["logprob_abs_diff"] < 1e-4
    assert rows[0]["updates"]["p2p"]["busiest_link_bytes"] < rows[0]["updates"]["broadcast"]["busiest_link_bytes"]


def test_staged_moe_updates_back_to_back_verify_what_is_served(tmp_path) -> None:
    """p2p only, into a staged engine (two storage sets swapped at every commit): the engine's
    checksums of its 3-D expert stacks read the storages it serves after each swap (they once
    read the previous set on every second update and reported a mismatch)."""
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--model", "tiny-qwen3-moe", "--trainer-tp", "2",
           "--trainer-ep", "2", "--trainer-etp", "1", "--engine-tp", "2", "--engine-ep", "2", "--steps", "3",
           "--mode", "p2p", "--staging", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [row["updates"]["p2p"]["checksum_ok"] for row in rows] == [True, True, True], \
        [row["updates"]["p2p"]["mismatch"] for row in rows]
