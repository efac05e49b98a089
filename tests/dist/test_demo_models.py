"""``shardsync demo`` on the newer families (mixture of experts, GLM4 dense, latent, sparse and linear
attention).
Mixture of experts: GRPO with the trainer's experts spread over its DP ranks (EP 2) into an
engine holding them EP 2 inside its TP group, synced by p2p and by broadcast, every update
checked bitwise and by the engine re-scoring the batch.

Heavy per-family runs (~2.5 min on 2 cores): deselected from the main suite, run by CI as their
own step (``pytest -q -m demos``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shardsync.layout.logical import logical_tensors, model_tensors
from shardsync.presets import PRESETS
from tests.fp8_straddle import straddle_config

pytestmark = pytest.mark.demos


def _demo(out: Path, model: str, *args: str, modes: tuple[str, ...] = ("p2p", "broadcast"),
          lp_diff: float = 1e-4) -> tuple[str, list]:
    """Run the demo; every update of every mode went its own path, bitwise, and the engine scores
    the batch as the trainer does (within ``lp_diff``).  Returns its stdout and steps."""
    cmd = [sys.executable, "-m", "shardsync.cli", "demo", "--model", model, *args, "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((out / "steps.json").read_text())["steps"]
    for row in rows:
        for mode in modes:
            u = row["updates"][mode]
            assert u["path"] == mode and u["checksum_ok"] is True, (row["step"], mode, u["mismatch"])
            assert u["logprob_abs_diff"] < lp_diff
    return r.stdout, rows


def _p2p_lighter(rows: list) -> bool:
    """p2p sends each engine rank only its own pieces: its busiest link carries less than broadcast's."""
    return rows[0]["updates"]["p2p"]["busiest_link_bytes"] < rows[0]["updates"]["broadcast"]["busiest_link_bytes"]


@pytest.mark.parametrize(("model", "trainer", "banner"), [
    ("tiny-qwen3-moe", ("--trainer-tp", "1", "--trainer-dp", "2", "--trainer-ep", "2"), "TP1 PP1 DP2 EP2 ETP1"),
    # latent attention: the topology
    ("tiny-deepseek-v3", ("--trainer-tp", "2", "--trainer-ep", "2", "--trainer-etp", "1"), "TP2 PP1 DP1 EP2 ETP1"),
    # sparse attention (GLM-5 shape): the indexer replicated everywhere, weights_proj bfloat16 on the engine
    ("tiny-glm5", ("--trainer-tp", "2", "--trainer-ep", "2", "--trainer-etp", "1"), "TP2 PP1 DP1 EP2 ETP1"),
    # gated DeltaNet hybrid: linear attention replicated on the trainer, key-head groups split on the engine
    ("tiny-qwen3-next", ("--trainer-tp", "2", "--trainer-ep", "2", "--trainer-etp", "1"), "TP2 PP1 DP1 EP2 ETP1"),
])
def test_expert_parallel_demo_p2p_and_broadcast_bitwise(tmp_path, model: str, trainer: tuple[str, ...],
                                                        banner: str) -> None:
    out, rows = _demo(tmp_path, model, *trainer, "--engine-tp", "2", "--engine-ep", "2", "--steps", "2")
    assert f"trainer {banner} -> engines TP [2] EP2" in out
    assert "bitwise checksum after every sync: ok" in out
    assert _p2p_lighter(rows)
    # MTP layers stay on the trainer (the engine's serving model holds none): every record counts them
    spec = PRESETS[model]
    mtp = sum(math.prod(s) for n, s in logical_tensors(spec).items() if n not in model_tensors(spec)) * 4
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert records and {r["unsent_bytes"] for r in records} == {mtp}
    assert (mtp > 0) == bool(spec.num_nextn_predict_layers)  # tiny-deepseek-v3 and tiny-qwen3-next have one, tiny-qwen3-moe none


def test_glm4_demo_p2p_and_broadcast_bitwise(tmp_path) -> None:
    """GLM4 dense: post norms, fused gate_up in the checkpoint, partial interleaved rotary."""
    out, _ = _demo(tmp_path, "tiny-glm4", "--steps", "2")
    assert "bitwise checksum after every sync: ok" in out
    # the last update on one clock: every trainer rank's buckets, as many as its record counts
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    rows = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert {"trainer rank 0", "trainer rank 1", "engine 0 pause"} <= set(rows.values())
    last = json.loads((tmp_path / "records-1.jsonl").read_text().splitlines()[-1])
    packs = [e for e in trace if e["ph"] == "X" and e["cat"] == "pack" and rows[e["pid"]] == "trainer rank 1"]
    assert len(packs) == len(last["steps"]) > 0
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"


def test_staged_moe_updates_back_to_back_verify_what_is_served(tmp_path) -> None:
    """p2p only, into a staged engine (two storage sets swapped at every commit): the engine's
    checksums of its 3-D expert stacks read the storages it serves after each swap (they once
    read the previous set on every second update and reported a mismatch)."""
    _, rows = _demo(tmp_path, "tiny-qwen3-moe", "--trainer-tp", "2", "--trainer-ep", "2", "--trainer-etp", "1",
                    "--engine-tp", "2", "--engine-ep", "2", "--steps", "3", "--mode", "p2p", "--staging",
                    modes=("p2p",))
    assert len(rows) == 3


def test_fp8_engine_demo(tmp_path) -> None:
    """An engine serving FP8 (128 x 128 blocks): every update bitwise in the e4m3 weights and scales
    the trainer quantized and sent (its shards are whole blocks: ``quant.wire``), each trainer rank
    quantizing (``quantize``) and changing FP8 bytes; the trainer/engine logprob gap is FP8's (fp32 trainer vs
    bf16 + FP8 engine: 3e-3 to 8e-3 measured on this model, docs/fp8.md), far above the 1e-6 of an
    unquantized engine."""
    out, rows = _demo(tmp_path, "tiny-qwen3-moe-fp8", "--trainer-tp", "2", "--trainer-ep", "2", "--trainer-etp", "1",
                      "--engine-tp", "2", "--engine-ep", "2", "--steps", "2", "--engine-quantization", "fp8",
                      lp_diff=5e-2)
    assert "serving fp8" in out and "bitwise checksum after every sync: ok" in out
    assert min(u["logprob_abs_diff"] for r in rows for u in r["updates"].values()) > 1e-5
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert records and all(r["phases"]["quantize"] > 0 and r["engines"] for r in records)
    # each step syncs the new weights by p2p, then the same weights again by broadcast: that
    # second quantization changes no FP8 byte; nothing arrives wide for the engines to quantize
    changed = {(r["version"], r["mode"]): r["quantized_changed"] for r in records}
    assert all((n > 0) == (mode == "p2p") for (_, mode), n in changed.items()), changed
    assert all(e["derived_changed"] == 0 for r in records for e in r["engines"])


@pytest.mark.parametrize(("trainer", "mode"), [(("--trainer-tp", "2"), "delta"),
                                              (("--trainer", "fsdp2", "--trainer-dp", "2"), "both")])
def test_fp8_engine_demo_with_blocks_the_trainer_shards_cut(tmp_path, trainer: tuple[str, ...], mode: str) -> None:
    """6 query heads of 64: the trainer's shards (Megatron TP 2, FSDP2's row halves) cut q_proj's
    middle 128-row block, which arrives wide and the engine quantizes; the rest arrives as the
    trainer's e4m3 bytes and scales.  Every update bitwise, delta updates included."""
    out, rows = _demo(tmp_path / "out", straddle_config(tmp_path), *trainer, "--engine-tp", "1", "--steps", "2",
                      "--engine-quantization", "fp8", "--mode", mode, modes=(), lp_diff=5e-2)
    assert "serving fp8" in out and "bitwise checksum after every sync: ok" in out
    records = [json.loads(line) for line in (tmp_path / "out" / "records.jsonl").read_text().splitlines()]
    # the first update (new weights): the trainer quantized its whole cells, the engine the cut
    # blocks (a broadcast of the same weights after it changes neither)
    first = [r for r in records if r["mode"] == "p2p" and r["version"] == 1]
    assert first and all(r["quantized_changed"] > 0 for r in first)
    assert all(e["derived_changed"] > 0 for r in first for e in r["engines"])
    assert {r["mode"] for r in records} == ({"p2p", "delta-p2p"} if mode == "delta" else {"p2p", "broadcast"})


@pytest.mark.parametrize(("model", "lp_diff"), [("tiny-deepseek-v32-fp8", 1e-1), ("tiny-qwen3-next-fp8", 5e-1)])
def test_fp8_engine_demo_sparse_and_linear_attention(tmp_path, model: str, lp_diff: float) -> None:
    """Sparse attention's indexer (``wq_b``, ``wk``) and gated DeltaNet's ``in_proj_qkvz`` /
    ``out_proj`` served in FP8 by the reference engine: every update bitwise in the e4m3 bytes and
    scales, the engine computing from them (a gap above an unquantized engine's; measured 1.9e-2
    and 1.8e-1 against 6e-2 for a bf16 Qwen3-Next engine: docs/fp8.md)."""
    out, rows = _demo(tmp_path, model, "--trainer-tp", "2", "--engine-tp", "2", "--steps", "2",
                      "--engine-quantization", "fp8", lp_diff=lp_diff)
    assert "serving fp8" in out and "bitwise checksum after every sync: ok" in out
    assert min(u["logprob_abs_diff"] for r in rows for u in r["updates"].values()) > 1e-5
