"""GLM4 (dense, GLM-4-0414): the preset against the published size, the spec from a HF config
(partial rotary under ``rope_parameters``), and logical tensors against the real
``transformers`` ``Glm4ForCausalLM``."""

from __future__ import annotations

import torch

from shardsync.layout.logical import logical_tensors
from shardsync.presets import PRESETS
from shardsync.spec import spec_from_config


def test_glm4_9b_has_the_published_size() -> None:
    assert abs(PRESETS["GLM-4-9B-0414"].num_parameters() / 1e9 - 9.40) < 0.01


def test_config_round_trip_keeps_partial_rotary() -> None:
    spec = PRESETS["tiny-glm4"]
    cfg = spec.to_hf_config()
    assert spec_from_config(cfg, name=spec.name) == spec
    cfg.pop("partial_rotary_factor")  # transformers 5 writes it under rope_parameters
    cfg["rope_parameters"] = {"rope_theta": spec.rope_theta, "partial_rotary_factor": 0.5, "rope_type": "default"}
    assert spec_from_config(cfg, name=spec.name) == spec
    assert spec.rotary_dim == spec.head_dim // 2


def test_tiny_glm4_logical_tensors_are_transformers_parameters() -> None:
    import transformers

    spec = PRESETS["tiny-glm4"]
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    assert type(cfg).__name__ == "Glm4Config"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    theirs = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert logical_tensors(spec) == theirs
    assert "model.layers.0.mlp.gate_up_proj.weight" in theirs and "model.layers.0.post_mlp_layernorm.weight" in theirs
