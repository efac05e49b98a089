"""Model specs: the few numbers of a decoder that decide every tensor's shape.

A spec comes from a HuggingFace ``config.json`` or from a named preset
(``shardsync.presets``); tiny presets exist for CPU tests and the demo.  Everything in
shardsync (layouts, plans, the reference models) is derived from a spec and its
family's tables (``shardsync.family``), so it never needs the checkpoint itself
to plan a sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from shardsync.family import ARCHITECTURES, FAMILIES, Family
from shardsync.family.section import S, Section, refuse_unknown
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
    num_nextn_predict_layers: int = 0  # MTP layers the checkpoint holds after the decoder
    # the numbers only some families have (latent attention, an indexer, linear attention), one
    # section of each kind the family declares (``Family.sections``; ``section`` / ``find``)
    sections: tuple[Section, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))  # JSON gives a list
        object.__setattr__(self, "sections", tuple(self.sections))
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
        kinds = [type(sec) for sec in self.sections]
        if sorted(k.key for k in kinds) != sorted(k.key for k in self.family_table.sections):
            raise ValueError(f"{self.name}: family {self.family} holds the sections "
                             f"{sorted(k.key for k in self.family_table.sections)}, got {sorted(k.key for k in kinds)}")
        broken = next((why for sec in self.sections if (why := sec.check(self))), None)
        broken = broken or (self.family_table.check(self) if self.family_table.check else None)
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
    def norm_offset(self) -> float:
        return self.family_table.norm_offset

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

    def find(self, kind: type[S]) -> S | None:
        """Its section of ``kind`` (or of a kind derived from it), if its family has one."""
        return next((sec for sec in self.sections if isinstance(sec, kind)), None)

    def section(self, kind: type[S]) -> S:
        """Its section of ``kind``, which code for that kind of model reads."""
        sec = self.find(kind)
        if sec is None:
            raise ValueError(f"{self.name} ({self.family}) has no {kind.key} section")
        return sec

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
        """Logical (HF) parameter count of the model, its MTP layers not counted; the tied
        embedding counts once."""
        from shardsync.layout.logical import model_tensors

        total = 0
        for shape in model_tensors(self).values():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @classmethod
    def build(cls, **fields: Any) -> ModelSpec:
        """A spec from flat fields, as a ``config.json`` spells them: the common ones, and the
        fields of the family's sections, gathered into them."""
        kinds = FAMILIES[fields["family"]].sections if fields.get("family") in FAMILIES else ()
        made = tuple(fields.pop("sections", ()))
        kinds = tuple(kind for kind in kinds if not any(isinstance(sec, kind) for sec in made))
        own = [{f.name: fields.pop(f.name) for f in dataclasses.fields(kind) if f.name in fields} for kind in kinds]
        return cls(**fields, sections=made + tuple(kind(**given) for kind, given in zip(kinds, own, strict=True)))

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with ``changes``: common fields, or fields of its sections (``kv_lora_rank=``)."""
        sections = []
        for sec in self.sections:
            mine = {f.name: changes.pop(f.name) for f in dataclasses.fields(sec) if f.name in changes}
            sections.append(dataclasses.replace(sec, **mine) if mine else sec)
        if "sections" in changes:
            return dataclasses.replace(self, **changes)
        return dataclasses.replace(self, **changes, sections=tuple(sections))

    def to_dict(self) -> dict[str, Any]:
        """Its JSON: the common fields, and each section under its key."""
        return {**dataclasses.asdict(self), "sections": {sec.key: dataclasses.asdict(sec) for sec in self.sections}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSpec:
        """The spec of its JSON (a peer's), refusing fields and sections no family declares."""
        refuse_unknown(cls, d, "model spec fields")
        raw = d.get("sections") or {}
        if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
            raise ValueError("a model spec's sections must be an object of objects (section key -> fields)")
        known = {kind.key: kind for fam in FAMILIES.values() for kind in fam.sections}  # every family's
        strange = sorted(set(raw) - set(known))
        if strange:
            raise ValueError(f"unknown model spec sections {strange}; known: {sorted(known)}")
        return cls(**{**d, "sections": tuple(known[k].from_dict(v) for k, v in raw.items())})

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
        for sec in self.sections:
            cfg.update(sec.write(self))
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
    fam = FAMILIES[family]
    try:
        own = fam.read(cfg) if fam.read else {}
        own["sections"] = tuple(kind.read(cfg) for kind in fam.sections)
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
        intermediate_size=cfg.get("intermediate_size", 0),  # all-MoE families may omit it (their reader fills it)
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
