"""Model specs: the few numbers of a decoder that decide every tensor's shape.

A spec comes from a HuggingFace ``config.json`` or from a named preset
(``PRESETS``); tiny presets exist for CPU tests and the demo.  Everything in
shardsync (layouts, plans, the reference models) is derived from a spec and its
family's tables (``shardsync.family``), so it never needs the checkpoint itself
to plan a sync.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardsync.family import ARCHITECTURES, FAMILIES, Family
from shardsync.family.table import dims

ROUTERS = ("softmax", "sigmoid")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSpec:
    """Shape-defining numbers of a decoder, dense or mixture-of-experts (HF naming); its family
    (``shardsync.family``) says which tensors those numbers shape."""

    name: str
    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    max_position_embeddings: int = 32768
    dtype: str = "bfloat16"
    # mixture of experts (Qwen3-MoE naming); num_experts == 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # every step-th layer is sparse ...
    mlp_only_layers: tuple[int, ...] = ()  # ... except these, which stay dense
    norm_topk_prob: bool = True
    # router: softmax over all experts (Qwen3-MoE) or sigmoid scores, a per-expert correction
    # bias for the choice only, group-limited top-k and a scaling (GLM4-MoE, DeepSeek-V3 style)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # GLM4-MoE: moe_intermediate_size * n_shared_experts
    partial_rotary_factor: float = 1.0  # rotary on the first head_dim * factor channels (GLM4: 0.5)
    attention_bias: bool | None = None  # None: the family's flag (GLM-4.5 reads it from the config)
    qk_layernorm: bool | None = None
    # multi-head latent attention (DeepSeek-V3 naming; kv_lora_rank 0: not MLA).  ``head_dim`` is
    # then the q/k head (nope + rope) and ``num_kv_heads`` equals ``num_heads``
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint holds after the decoder

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # JSON gives a list
        if self.family not in FAMILIES:
            raise ValueError(
                f"unknown model family {self.family!r}; supported: {sorted(FAMILIES)}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} not supported; use one of {DTYPES}")
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "intermediate_size", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{self.name}: {key} must be positive, got {getattr(self, key)}")
        moe = self.family_table.is_moe
        if moe != (self.num_experts > 0):
            raise ValueError(f"{self.name}: family {self.family} {'needs' if moe else 'takes no'} experts "
                             f"(num_experts={self.num_experts})")
        if moe and not (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
                        and self.decoder_sparse_step > 0):
            raise ValueError(f"{self.name}: experts need 0 < num_experts_per_tok <= num_experts, a positive "
                             "moe_intermediate_size and decoder_sparse_step")
        if moe and self.router not in ROUTERS:
            raise ValueError(f"{self.name}: router {self.router!r} not one of {ROUTERS}")
        if moe and (self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group
                    or (self.router == "sigmoid" and self.num_experts // self.n_group < 2)):
            raise ValueError(f"{self.name}: expert groups need n_group dividing num_experts into groups of >= 2 "
                             f"and 0 < topk_group <= n_group "
                             f"(got {self.num_experts}, {self.n_group}, {self.topk_group})")
        broken = self.family_table.check(self) if self.family_table.check else None
        if broken:
            raise ValueError(f"{self.name}: {broken}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def family_table(self) -> Family:
        """The family's declarative tables (``shardsync.family``)."""
        return FAMILIES[self.family]

    @property
    def qkv_bias(self) -> bool:
        return self.family_table.qkv_bias if self.attention_bias is None else self.attention_bias

    @property
    def qk_norm(self) -> bool:
        return self.family_table.qk_norm if self.qk_layernorm is None else self.qk_layernorm

    @property
    def post_norms(self) -> bool:
        return self.family_table.post_norms

    @property
    def fused_gate_up(self) -> bool:
        return self.family_table.fused_gate_up

    @property
    def rope_interleaved(self) -> bool:
        return self.family_table.rope_interleaved

    @property
    def rotary_dim(self) -> int:
        return dims(self)[self.family_table.attention.rotary]  # the attention block names it

    @property
    def architecture(self) -> str:
        return self.family_table.architecture

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (the family's attention block is MLA)."""
        return self.family_table.attention.kind == "mla"

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has experts (the HF Qwen3-MoE rule)."""
        return (self.is_moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_parameters(self) -> int:
        """Logical (HF) parameter count; the tied embedding counts once."""
        from shardsync.layout.logical import logical_tensors

        total = 0
        for shape in logical_tensors(self).values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    def replace(self, **changes: Any) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` builds the same model from."""
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,  # engines rewrite theirs
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "pad_token_id": None,  # a family default (GLM4: 151329) may lie outside a tiny vocab
        }
        if self.partial_rotary_factor != 1.0:
            cfg["partial_rotary_factor"] = self.partial_rotary_factor
        if self.family_table.write:
            cfg.update(self.family_table.write(self))
        return cfg


# rope types engines rename in the config they serve (SGLang's DeepSeek classes: yarn)
ROPE_TYPE_ALIASES = {"deepseek_yarn": "yarn"}


def _rope_scaling(raw: dict[str, Any] | None) -> dict[str, Any] | None:
    """The scaling settings alone, under one spelling: ``rope_type`` (legacy ``type``), no
    ``rope_theta`` / ``partial_rotary_factor`` (transformers 5 keeps them in the same dict)."""
    if not raw:
        return None
    out = {k: v for k, v in raw.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return None
    out["rope_type"] = ROPE_TYPE_ALIASES.get(kind, kind)
    return out


def spec_from_config(cfg: dict[str, Any], name: str) -> ModelSpec:
    """The spec of a HuggingFace ``config.json`` dict (an engine reads its own model's)."""
    return _from_config_dict(cfg, name)


def _from_config_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    archs = cfg.get("architectures") or []
    family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if family is None and not archs and cfg.get("model_type") in FAMILIES:
        family = cfg["model_type"]
    if family is None:
        raise ValueError(
            f"{name}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"supported architectures: {sorted(ARCHITECTURES)} (dense decoders only)"
        )
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    # transformers 5 writes rope settings under rope_parameters instead of the top level.
    rope = dict(cfg.get("rope_parameters") or {})
    theta = cfg.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
    rope.pop("rope_theta", None)
    scaling = cfg.get("rope_scaling")
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    scaling = _rope_scaling(scaling)
    head_dim = cfg.get("head_dim") or hidden // heads
    read = FAMILIES[family].read
    try:
        own = read(cfg) if read else {}
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    partial = cfg.get("partial_rotary_factor") or rope.pop("partial_rotary_factor", None) or 1.0
    rope.pop("partial_rotary_factor", None)
    fields: dict[str, Any] = dict(
        name=name,
        family=family,
        hidden_size=hidden,
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16",
        partial_rotary_factor=float(partial),
    )
    return ModelSpec(**{**fields, **own})  # the family's own reading wins (MLA: head_dim)


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _yarn(factor: float, original: int, *, beta_fast: float, beta_slow: float) -> dict[str, Any]:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": beta_fast, "beta_slow": beta_slow, "mscale": 1.0, "mscale_all_dim": 1.0}


def _mla(q_lora: int | None, kv_lora: int, nope: int, rope: int, v: int, nextn: int = 0) -> dict[str, Any]:
    return {"q_lora_rank": q_lora, "kv_lora_rank": kv_lora, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
            "v_head_dim": v, "num_nextn_predict_layers": nextn}


def _sigmoid_moe(experts: int, top_k: int, inter: int, *, shared: int, dense: int, scale: float,
                 groups: tuple[int, int] = (1, 1)) -> dict[str, Any]:
    return {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": inter,
            "shared_expert_intermediate_size": shared * inter, "mlp_only_layers": tuple(range(dense)),
            "router": "sigmoid", "n_group": groups[0], "topk_group": groups[1], "routed_scaling_factor": scale}


def _preset(name: str, family: str, H: int, L: int, h: int, ng: int, d: int, F: int, V: int,
            tied: bool, **extra: Any) -> ModelSpec:
    base: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, **FAMILIES[family].defaults, **extra}
    return ModelSpec(name=name, family=family, hidden_size=H, num_layers=L, num_heads=h,
                     num_kv_heads=ng, head_dim=d, intermediate_size=F, vocab_size=V,
                     tie_word_embeddings=tied, **base)


# Numbers from each model's published HuggingFace config.json (docs/models.md, "Presets").  Tiny presets: a few million
# parameters, GQA, vocab not a multiple of 64 (exercises engine vocab padding).
_PRESET_LIST = [
    _preset("Qwen3-0.6B", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-1.7B", "qwen3", 2048, 28, 16, 8, 128, 6144, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-4B", "qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True, max_position_embeddings=40960),
    _preset("Qwen3-8B", "qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False, max_position_embeddings=40960),
    _preset("Qwen3-14B", "qwen3", 5120, 40, 40, 8, 128, 17408, 151936, False, max_position_embeddings=40960),
    _preset("Qwen3-32B", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936, False, max_position_embeddings=40960),
    _preset("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 64, 4864, 151936, True),
    _preset("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True),
    _preset("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False),
    _preset("Llama-3.2-1B", "llama", 2048, 16, 32, 8, 64, 8192, 128256, True,
            rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072),
    _preset("Llama-3.2-3B", "llama", 3072, 28, 24, 8, 128, 8192, 128256, True,
            rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072),
    _preset("Llama-3.1-8B", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072),
    _preset("Llama-3.1-70B", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072),
    # tiny variants (CPU): head_dim != hidden/heads for Qwen3, as in the real family.
    _preset("tiny-qwen3", "qwen3", 256, 4, 8, 2, 64, 512, 1100, True,
            max_position_embeddings=2048, dtype="float32"),
    _preset("tiny-qwen2", "qwen2", 256, 4, 8, 2, 32, 640, 1000, True,
            max_position_embeddings=2048, dtype="float32"),
    _preset("tiny-llama", "llama", 256, 4, 8, 4, 32, 512, 1200, False,
            rope_scaling=_llama3_rope(8.0), max_position_embeddings=16384, dtype="float32"),
    # GLM4 dense (GLM-4-0414 architecture): post-attention and post-MLP norms, partial interleaved rotary
    _preset("GLM-4-9B-0414", "glm4", 4096, 40, 32, 2, 128, 13696, 151552, False, rms_norm_eps=1.5625e-07,
            rope_theta=10000.0, partial_rotary_factor=0.5),
    _preset("tiny-glm4", "glm4", 256, 4, 8, 2, 64, 512, 1100, False, max_position_embeddings=2048,
            rope_theta=10000.0, partial_rotary_factor=0.5, dtype="float32"),
    # GLM-4.5-Air (GLM4-MoE): 1 dense layer, 128 routed experts + 1 shared, sigmoid router; the
    # checkpoint's MTP layer (model.layers.46) is not part of the model shardsync syncs
    _preset("GLM-4.5-Air", "glm4_moe", 4096, 46, 96, 8, 128, 10944, 151552, False, rms_norm_eps=1e-5,
            partial_rotary_factor=0.5, max_position_embeddings=131072, num_experts=128, num_experts_per_tok=8,
            moe_intermediate_size=1408, mlp_only_layers=(0,), router="sigmoid", shared_expert_intermediate_size=1408,
            attention_bias=True, qk_layernorm=False),
    # tiny: expert groups (2 of 4, top-1 group) and a routed scaling, q/k norms as GLM-4.5 (not Air)
    _preset("tiny-glm4-moe", "glm4_moe", 256, 4, 8, 2, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", partial_rotary_factor=0.5, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
            mlp_only_layers=(0,), router="sigmoid", n_group=2, topk_group=1, routed_scaling_factor=2.5,
            shared_expert_intermediate_size=128, attention_bias=True, qk_layernorm=True),
    # multi-head latent attention (DeepSeek-V3 architecture; docs/models.md names the sources).  d = nope + rope.
    _preset("DeepSeek-V3", "deepseek_v3", 7168, 61, 128, 128, 192, 18432, 129280, False, rope_theta=10000.0,
            rope_scaling=_yarn(40.0, 4096, beta_fast=32.0, beta_slow=1.0), max_position_embeddings=163840,
            **_mla(1536, 512, 128, 64, 128, nextn=1), **_sigmoid_moe(256, 8, 2048, shared=1, dense=3, groups=(8, 4),
                                                                  scale=2.5)),
    _preset("Kimi-K2", "deepseek_v3", 7168, 61, 64, 64, 192, 18432, 163840, False, rope_theta=50000.0,
            rope_scaling=_yarn(32.0, 4096, beta_fast=1.0, beta_slow=1.0), max_position_embeddings=131072,
            **_mla(1536, 512, 128, 64, 128), **_sigmoid_moe(384, 8, 2048, shared=1, dense=1, scale=2.827)),
    _preset("GLM-4.7-Flash", "glm4_moe_lite", 2048, 47, 20, 20, 256, 10240, 154880, False, rms_norm_eps=1e-5,
            max_position_embeddings=202752, **_mla(768, 512, 192, 64, 256, nextn=1),
            **_sigmoid_moe(64, 4, 1536, shared=1, dense=1, scale=1.8)),
    # tiny (CPU): yarn rope, expert groups, one dense layer; a q_proj variant (no q_lora_rank); GLM's wider
    # nope and v heads than rope
    _preset("tiny-deepseek-v3", "deepseek_v3", 256, 4, 8, 8, 48, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(64, 32, 32, 16, 32), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, groups=(2, 1), scale=2.5)),
    _preset("tiny-deepseek-v3-q-proj", "deepseek_v3", 256, 4, 8, 8, 48, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", rope_theta=10000.0, rope_scaling=_yarn(4.0, 512, beta_fast=32.0, beta_slow=1.0),
            **_mla(None, 32, 32, 16, 32), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, groups=(2, 1), scale=2.5)),
    _preset("tiny-glm4-moe-lite", "glm4_moe_lite", 256, 4, 8, 8, 64, 512, 1100, False, max_position_embeddings=2048,
            dtype="float32", **_mla(64, 32, 48, 16, 64), **_sigmoid_moe(8, 2, 128, shared=1, dense=1, scale=1.8)),
    # mixture of experts
    _preset("Qwen3-30B-A3B", "qwen3_moe", 2048, 48, 32, 4, 128, 6144, 151936, False,
            max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
    _preset("Qwen3-235B-A22B", "qwen3_moe", 4096, 94, 64, 4, 128, 12288, 151936, False,
            max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=1536),
    # tiny: a dense first layer (mlp_only_layers) and a sparse step of 1, vocab not a multiple of 64
    _preset("tiny-qwen3-moe", "qwen3_moe", 256, 4, 8, 2, 64, 512, 1100, True, max_position_embeddings=2048,
            dtype="float32", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, mlp_only_layers=(0,)),
]
PRESETS: dict[str, ModelSpec] = {s.name: s for s in _PRESET_LIST}


def load_spec(model: str | Path, *, dtype: str | None = None) -> ModelSpec:
    """Resolve a preset name, a ``config.json`` path or a checkpoint directory to a spec."""
    key = str(model)
    if key in PRESETS:
        spec = PRESETS[key]
    else:
        path = Path(key)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {key!r} is neither a preset nor a config.json/checkpoint directory; "
                f"presets: {', '.join(PRESETS)}"
            )
        spec = _from_config_dict(json.loads(path.read_text()), name=path.parent.name or key)
    return spec.replace(dtype=dtype) if dtype else spec
