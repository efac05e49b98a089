"""Qwen3-MoE specs: presets against the published models, logical tensors against the real
``transformers`` model built from the spec's config, and the clear refusal of layouts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.layout.logical import logical_tensors
from shardsync.presets import PRESETS
from shardsync.spec import spec_from_config
from shardsync.topology import Topology


@pytest.mark.parametrize(("name", "billions"), [("Qwen3-30B-A3B", 30.5), ("Qwen3-235B-A22B", 235.1)])
def test_moe_presets_have_the_published_size(name: str, billions: float) -> None:
    assert abs(PRESETS[name].num_parameters() / 1e9 - billions) < 0.1


def test_tiny_moe_logical_tensors_are_transformers_parameters() -> None:
    import transformers

    spec = PRESETS["tiny-qwen3-moe"]
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ours = logical_tensors(spec)
    if spec.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    # transformers may hold experts fused ([E, 2F, H] / [E, H, F]); compare per expert then
    fused = {n: s for n, s in theirs.items() if ".experts." in n and not n.split(".experts.")[1][0].isdigit()}
    for n in fused:
        theirs.pop(n)
    mine_experts = {n for n in ours if ".experts." in n}
    assert {n: s for n, s in ours.items() if n not in mine_experts} == theirs
    assert spec.sparse_layer(0) is False and all(spec.sparse_layer(i) for i in range(1, spec.num_layers))
    E, F, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    assert len(mine_experts) == 3 * E * (spec.num_layers - 1)
    if fused:  # fused expert tensors hold exactly our per-expert tensors' elements
        per_layer = sum(torch.Size(s).numel() for s in fused.values()) // (spec.num_layers - 1)
        assert per_layer == 3 * E * F * H


def test_config_round_trip_keeps_the_experts() -> None:
    spec = PRESETS["tiny-qwen3-moe"]
    assert spec_from_config(spec.to_hf_config(), name=spec.name) == spec


def test_layouts_refuse_impossible_expert_splits_with_the_reason() -> None:
    spec = PRESETS["tiny-qwen3-moe"]
    cases = [
        (MegatronParallel(tp=2, ep=2), EngineParallel(tp=2), "etp x ep = 2x2 must divide tp x dp"),
        (MegatronParallel(tp=1, dp=3, ep=3), EngineParallel(tp=2), "num_experts=8 not divisible by ep=3"),
        (MegatronParallel(tp=1), EngineParallel(tp=2, ep=4), "ep=4 must divide tp=2"),
        (MegatronParallel(tp=1), EngineParallel(tp=4, ep=1, vocab_pad=64), None),
    ]
    for trainer, engine, why in cases:
        topo = Topology(spec, trainer, (engine,))
        if why is None:
            assert topo.p2p_plan.total_bytes > 0
            continue
        with pytest.raises(ValueError, match=why):
            _ = topo.trainer_layout, topo.engines_layout
    dense = Topology(PRESETS["tiny-qwen3"], MegatronParallel(tp=1, dp=2, ep=2), (EngineParallel(tp=2),))
    with pytest.raises(ValueError, match="mixture-of-experts models only"):
        _ = dense.trainer_layout


def test_plan_cli_plans_moe_with_expert_parallel() -> None:
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "plan", "--model", "Qwen3-30B-A3B",
                        "--trainer-tp", "2", "--trainer-dp", "4", "--trainer-ep", "4", "--engine-tp", "4",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    report = json.loads(r.stdout)
    assert report["p2p_ok"] and report["trainer"]["ep"] == 4
    p2p, bcast = (next(p for p in report["paths"] if p["path"] == k) for k in ("p2p", "broadcast"))
    spec = PRESETS["Qwen3-30B-A3B"]
    assert bcast["per_receiver_bytes"] == 2 * spec.num_parameters()  # bf16: the whole model per rank
    assert p2p["per_receiver_bytes"] * 4 < bcast["per_receiver_bytes"] * 1.01  # a quarter, plus norms


def test_plan_cli_refuses_an_impossible_split_with_the_reason_not_a_traceback() -> None:
    r = subprocess.run([sys.executable, "-m", "shardsync.cli", "plan", "--model", "Qwen3-30B-A3B",
                        "--trainer-tp", "2", "--trainer-ep", "3", "--engine-tp", "4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "must divide tp x dp" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
