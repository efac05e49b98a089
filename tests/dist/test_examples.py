"""``examples/run.py`` as a user runs it (subprocesses from the repo root): list, prepare
(random weights, sharded, and converted from a transformers checkpoint) and run for the
Qwen3-4B recipe's tiny variant."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardsync.layout import MegatronParallel, logical_tensors, megatron_layout
from shardsync.models.weights import checkpoint_source, random_source
from shardsync.presets import PRESETS, load_spec

ROOT = Path(__file__).resolve().parents[2]


def example(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/run.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt") / "qwen3-4b-tiny"
    ok(example("prepare", "Qwen3-4B", "--size", "tiny", "--out", str(out), "--shard-mb", "2"))
    return out


def test_list():
    out = ok(example("list"))
    for model in ("Qwen3-4B", "Qwen3-8B", "Llama-3.1-8B", "Qwen3-32B", "Llama-3.1-70B"):
        assert model in out
    rows = {r["model"]: r for r in json.loads(ok(example("list", "--json")))}
    assert rows["Qwen3-4B"]["nodes"] == 1 and rows["Qwen3-4B"]["tiny"] == "tiny-qwen3"
    assert (rows["Qwen3-4B"]["gpu_trainer_tp"], rows["Qwen3-4B"]["gpu_engine_tp"]) == (4, [4])
    assert rows["Llama-3.1-70B"]["nodes"] > 1
    # mixture of experts: experts over the trainer's DP ranks, EP = TP on the engines
    for model, tiny in (("Qwen3-30B-A3B", "tiny-qwen3-moe"), ("Qwen3-235B-A22B", "tiny-qwen3-moe"),
                        ("GLM-4.5-Air", "tiny-glm4-moe")):
        assert rows[model]["tiny"] == tiny and rows[model]["gpu_trainer_ep"] == rows[model]["gpu_engine_ep"] == 8
    # latent attention: the published topologies, each with its tiny variant on CPU
    for model, tiny in (("DeepSeek-V3", "tiny-deepseek-v3"), ("Kimi-K2", "tiny-deepseek-v3"),
                        ("GLM-4.7-Flash", "tiny-glm4-moe-lite")):
        assert rows[model]["tiny"] == tiny and rows[model]["cpu_engine_ep"] == 2
    assert rows["DeepSeek-V3"]["nodes"] == rows["Kimi-K2"]["nodes"] == 64
    # sparse attention: GLM-5 as the examples run it (16 + 16 nodes), its 4-layer variant on one node
    for model, tiny in (("GLM-5", "tiny-glm5"), ("GLM-5-4layer", "tiny-glm5"), ("DeepSeek-V3.2", "tiny-deepseek-v32")):
        assert rows[model]["tiny"] == tiny and rows[model]["cpu_engine_ep"] == 2
    assert (rows["GLM-5"]["nodes"], rows["GLM-5-4layer"]["nodes"]) == (32, 2)
    assert rows["Qwen3-Next-80B-A3B"]["tiny"] == "tiny-qwen3-next" and rows["Qwen3-Next-80B-A3B"]["nodes"] == 2


def test_prepare_random_tiny(tiny_ckpt):
    spec = load_spec(tiny_ckpt)
    assert spec.replace(name="tiny-qwen3") == PRESETS["tiny-qwen3"]
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(logical_tensors(spec))
    assert len(set(index["weight_map"].values())) > 1  # sharded at 2 MiB
    got, want = checkpoint_source(tiny_ckpt), random_source(spec, 0)
    for name in logical_tensors(spec):
        assert torch.equal(got(name), want(name)), name
    layout = json.loads((tiny_ckpt / "megatron_layout.json").read_text())
    ref = megatron_layout(spec, MegatronParallel(tp=2, dtype="float32"))
    assert layout["trainer"]["tp"] == 2 and len(layout["ranks"]) == 2
    for rank, rl in zip(layout["ranks"], ref.ranks, strict=True):
        assert [(t["name"], tuple(t["shape"])) for t in rank["tensors"]] == [(t.name, t.shape) for t in rl.tensors]
        assert sum(len(t["pieces"]) for t in rank["tensors"]) == len(rl.pieces)


def test_prepare_loads_in_transformers_and_converts_back(tiny_ckpt, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_ckpt))
    hf = tmp_path / "hf"
    model.save_pretrained(str(hf))  # a checkpoint as transformers writes it
    out = tmp_path / "converted"
    ok(example("prepare", "Qwen3-4B", "--size", "tiny", "--from-hf", str(hf), "--out", str(out)))
    spec = load_spec(out)
    state = model.state_dict()
    got = checkpoint_source(out)
    for name in logical_tensors(spec):
        assert torch.equal(got(name), state[name]), name
    assert json.loads((out / "megatron_layout.json").read_text())["source"].startswith("hf:")


def test_prepare_refuses_other_family(tiny_ckpt, tmp_path):
    proc = example("prepare", "Llama-3.1-8B", "--size", "tiny", "--from-hf", str(tiny_ckpt),
                   "--out", str(tmp_path / "x"))
    assert proc.returncode != 0 and "qwen3 model but Llama-3.1-8B is llama" in proc.stderr


@pytest.mark.demos  # ~15 s: the example's run end to end, in CI's demos step
def test_run_tiny_from_checkpoint(tiny_ckpt, tmp_path):
    out = ok(example("run", "Qwen3-4B", "--size", "tiny", "--checkpoint", str(tiny_ckpt),
                     "--steps", "2", "--mode", "p2p", "--out", str(tmp_path)))
    assert "tiny variant tiny-qwen3" in out and "bitwise checksum after every sync: ok" in out
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [r["updates"]["p2p"]["checksum_ok"] for r in rows] == [True, True]
    assert rows[0]["logprob_abs_diff"] < 1e-4  # engine and trainer started from the same weights


@pytest.mark.demos  # ~15 s
def test_run_bucket_env_and_delta(tmp_path):
    proc = example("run", "Qwen3-4B", "--size", "tiny", "--steps", "2", "--mode", "delta",
                   "--out", str(tmp_path), env={"SHARDSYNC_BUCKET_MB": "0.25"})
    if proc.returncode == 2:  # a runtime without delta: a clear refusal, nothing started
        assert "--mode delta is not available" in proc.stderr
        return
    out = ok(proc)
    assert "buckets 0.25 MiB" in out and "bitwise checksum after every sync: ok" in out
    rows = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert rows[1]["updates"]["delta"]["path"].startswith("delta-")
