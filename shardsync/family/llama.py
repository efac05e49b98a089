"""Llama 3.x: grouped-query attention without biases or q/k norms, llama3 rope scaling."""

from __future__ import annotations

from typing import Any

from shardsync.family.blocks import GQA, gated_mlp
from shardsync.family.table import Family


def _read(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise ValueError("Llama with attention_bias=true is not supported")
    return {}


LLAMA = Family("llama", "LlamaForCausalLM", GQA, gated_mlp(), lm_head_every_stage=True, read=_read,
               write=lambda spec: {"mlp_bias": False}, defaults={"rms_norm_eps": 1e-5, "rope_theta": 500_000.0})
