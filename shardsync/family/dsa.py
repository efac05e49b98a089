"""DeepSeek sparse attention families: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``) and GLM-5
(``GlmMoeDsaForCausalLM``): DeepSeek-V3's latent attention, experts and MTP layer, plus a
lightning indexer per layer that picks each query's keys.  GLM-5's indexer turns neighbouring
rotary pairs, DeepSeek-V3.2's halves; GLM-5 may let a layer reuse the layer before's choice
(``indexer_types`` "shared": that layer holds no indexer).  SGLang 0.5.23 serves both with
its DeepSeek classes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from shardsync.family.blocks import DSA, MLA, MOE, MTP, gated_mlp
from shardsync.family.fields import first_k_dense, read_mla, read_sigmoid_moe, write_mla, write_sigmoid_moe
from shardsync.family.section import Indexer, Latent
from shardsync.family.table import Attention, Family

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def _read(cfg: dict[str, Any]) -> dict[str, Any]:
    if cfg.get("attention_bias"):
        raise ValueError("latent attention with attention_bias=true is not supported")
    if cfg.get("index_k_norm_type", "layernorm") != "layernorm" or (cfg.get("index_kpool") or 1) > 1:
        raise ValueError("an indexer with an RMS key norm or a key pool (index_k_norm_type, index_kpool) is not "
                         "supported")
    return {**read_mla(cfg), **read_sigmoid_moe(cfg)}


@dataclass(frozen=True)
class EveryLayerIndexer(Indexer):
    """DeepSeek-V3.2's indexer: on every layer (its config has no ``indexer_types``)."""

    key: ClassVar[str] = "indexer_every_layer"

    def write(self, spec: ModelSpec) -> dict[str, Any]:
        own = super().write(spec)
        del own["indexer_types"]  # not a DeepSeek-V3.2 config key
        return own

    def check(self, spec: ModelSpec) -> str | None:
        if self.index_shared_layers:
            return "DeepSeek-V3.2 runs the indexer on every layer (index_shared_layers must be empty)"
        return super().check(spec)


def _write_v32(spec: ModelSpec) -> dict[str, Any]:
    return {**write_mla(spec), **write_sigmoid_moe(spec)}


def _write_glm5(spec: ModelSpec) -> dict[str, Any]:
    k = len(spec.mlp_only_layers)
    return {**write_mla(spec), **write_sigmoid_moe(spec),
            "mlp_layer_types": ["dense"] * k + ["sparse"] * (spec.num_layers - k),
            "indexer_rope_interleave": True}  # what GLM-5's config says and SGLang reads


# a shared layer: latent attention over the keys the layer before chose
SHARED_DSA = dataclasses.replace(MLA, kind=Attention.DSA_SHARED)

DEEPSEEK_V32 = Family("deepseek_v32", "DeepseekV32ForCausalLM", DSA, gated_mlp(), MOE, mtp=MTP,
                      rope_interleaved=True, sections=(Latent, EveryLayerIndexer), read=_read, write=_write_v32,
                      check=first_k_dense)
GLM_MOE_DSA = Family("glm_moe_dsa", "GlmMoeDsaForCausalLM", DSA, gated_mlp(), MOE, mtp=MTP, shared_attention=SHARED_DSA,
                     rope_interleaved=True, index_rope_interleaved=True,
                     sections=(Latent, Indexer), read=_read, write=_write_glm5, check=first_k_dense)
