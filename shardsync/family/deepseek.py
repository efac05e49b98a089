"""DeepSeek-V3 (also Kimi-K2, the same architecture) and GLM-4.7-Flash (GLM4-MoE-Lite):
multi-head latent attention, the first k layers dense, then sigmoid-routed experts with a
score-correction bias, expert groups and one shared expert; the checkpoint's MTP layers
(``num_nextn_predict_layers``) after the decoder."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from shardsync.family.blocks import MLA, MOE, MTP, gated_mlp, moe
from shardsync.family.fields import first_k_dense, read_mla, read_sigmoid_moe, write_mla, write_sigmoid_moe
from shardsync.family.section import Latent
from shardsync.family.table import Family

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def _read(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise ValueError("latent attention with attention_bias=true is not supported")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func={cfg['scoring_func']!r} is not supported (sigmoid routers only)")
    return {**read_mla(cfg), **read_sigmoid_moe(cfg)}


def _write(spec: ModelSpec) -> dict[str, Any]:
    return {**write_mla(spec), **write_sigmoid_moe(spec)}


def _write_lite(spec: ModelSpec) -> dict[str, Any]:
    # transformers' Glm4MoeLiteConfig reads its dense layers from mlp_layer_types only
    k = len(spec.mlp_only_layers)
    return {**_write(spec), "mlp_layer_types": ["dense"] * k + ["sparse"] * (spec.num_layers - k)}


DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", MLA, gated_mlp(), MOE, mtp=MTP, rope_interleaved=True,
                     sections=(Latent,), read=_read, write=_write, check=first_k_dense)
GLM4_MOE_LITE = Family("glm4_moe_lite", "Glm4MoeLiteForCausalLM", MLA, gated_mlp(), moe(router_dtype="float32"),
                       mtp=MTP, rope_interleaved=True,
                       sections=(Latent,), read=_read, write=_write_lite, check=first_k_dense)
