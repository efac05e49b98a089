"""The vocabulary of a model family's tables: logical tensors, and the rows that say how
each layout's local tensors are cut from them.

A family is data: its HF config fields, its logical tensors per layer kind, and for each
layout a row per local tensor naming a *kind*: a rule that cuts it (``cut.Kind``; the shared
ones, ``Whole``, ``Split``, ``Fused``, ``QkvGroups``..., in ``kinds.py``, a family's own in its
module).  Nothing here builds a piece.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardsync.family.section import Indexer, Linear, Section
from shardsync.vocab import Word

if TYPE_CHECKING:
    from shardsync.family.cut import Kind
    from shardsync.spec import ModelSpec

Predicate = Callable[["ModelSpec"], bool]


def always(spec: ModelSpec) -> bool:
    return True


def dims(spec: ModelSpec) -> dict[str, int]:
    """The symbols logical shapes are written in: the common ones, and each section's own."""
    d, h = spec.head_dim, spec.num_heads
    out = {"H": spec.hidden_size, "2H": 2 * spec.hidden_size, "d": d, "q": h * d, "kv": spec.num_kv_heads * d,
           "F": spec.intermediate_size, "2F": 2 * spec.intermediate_size, "E": spec.num_experts,
           "Fe": spec.moe_intermediate_size, "Fs": spec.shared_expert_intermediate_size,
           # q up rows (heads x head width; MLA: nope + rope), rotary's share of a head (partial rotary),
           # every head's query and gate rows (Qwen3-Next's gated q_proj)
           "qh": h * d, "rot": int(d * spec.partial_rotary_factor), "q2": 2 * h * d, "one": 1}
    for sec in spec.sections:
        out.update(sec.dims(spec))
    return out


class Attention(Word):
    """The attention a block computes: grouped-query (``GQA``; gated: Qwen3-Next's full-attention
    layers), latent (``MLA``), sparse (``DSA``; ``DSA_SHARED`` reuses the layer before's choice)
    and gated DeltaNet (``GDN``; ``GDN_STACKED`` with the checkpoint's projections stacked, not
    interleaved).  The reference models build one module per word."""

    GQA = "gqa"
    GQA_GATED = "gqa_gated"
    MLA = "mla"
    DSA = "dsa"
    DSA_SHARED = "dsa_shared"
    GDN = "gdn"
    GDN_STACKED = "gdn_stacked"


class Supports(Word):
    """A weight view a block's linears take: FP8 engines (its engine rows' ``fp8`` name every
    linear an FP8 engine quantizes) and LoRA adapters on its modules (``lora.table``)."""

    FP8 = "fp8"
    ADAPTER = "adapter"


class Variant(Word):
    """The layout variant words a row may name (``Row.variant`` / ``Row.unless``): Megatron's
    layer specs (``FUSED`` the TE spec, ``SEPARATE`` the local one) and the engines' departures
    from their default layout (``layout.engine.ENGINE_VARIANTS`` says what each means)."""

    FUSED = "fused"
    SEPARATE = "separate"
    SHARED_FUSED = "shared_fused"
    VLLM = "vllm"
    INDEXER_FUSED = "indexer_fused"


# -- logical tensors ---------------------------------------------------------------------------

@dataclass(frozen=True, init=False)
class T:
    """A logical (HF) tensor of a layer: its name after ``model.layers.{L}.`` and its shape in
    ``dims`` symbols.  ``{e}`` in the name: one per routed expert (``PerExpert``)."""

    name: str
    shape: tuple[str, ...]
    when: Predicate = always

    def __init__(self, name: str, *shape: str, when: Predicate = always) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "when", when)


@dataclass(frozen=True)
class PerExpert:
    """Tensors every routed expert has, listed expert by expert (the checkpoint order)."""

    tensors: tuple[T, ...]


@dataclass(frozen=True)
class Row:
    """One local tensor of a layout (or a set of them, for expert kinds): its name after the
    layer prefix, how it is cut, when it exists, its dtype when not the model's, and the
    layout variants it exists in: only where ``variant`` is one of the layout's variant words,
    never where ``unless`` is (Megatron: ``fused`` is the TE layer spec, ``separate`` the
    local spec; engines: ``ENGINE_VARIANTS`` in ``layout/engine.py``).  ``fp8``: an FP8 engine
    holds the tensors this engine row cuts in e4m3 with block scales (``quant.targets``), as
    the DeepSeek-V3 and Qwen3 FP8 checkpoints hold their linears."""

    name: str
    kind: Kind
    when: Predicate = always
    dtype: str | None = None
    variant: str | None = None
    unless: str | tuple[str, ...] | None = None
    fp8: bool = False

    def __post_init__(self) -> None:
        unless = (self.unless,) if isinstance(self.unless, str) else self.unless or ()
        for word in (self.variant, *unless):
            if word is not None:  # a typo would make the row vanish silently: refused at import
                Variant.parse(word, f"row {self.name}'s layout variant")

    def exists(self, spec: ModelSpec, variants: frozenset[str]) -> bool:
        unless = (self.unless,) if isinstance(self.unless, str) else self.unless or ()
        return (self.when(spec) and (self.variant is None or self.variant in variants)
                and not variants.intersection(unless))


@dataclass(frozen=True)
class SharedExpert:
    """A mixture-of-experts block's shared expert as the engine holds it: the module under
    ``mlp.`` (``shared_experts``, Qwen3-Next's ``shared_expert``) and whether a sigmoid gate
    (``mlp.shared_expert_gate``) scales its output."""

    module: str = "shared_experts"
    gated: bool = False


@dataclass(frozen=True)
class Block:
    """A part of a decoder layer in every layout: logical tensors and each layout's rows,
    in parameter order."""

    logical: tuple[T | PerExpert, ...]
    megatron: tuple[Row, ...]
    engine: tuple[Row, ...]
    kind: Attention | None = None  # attention blocks: what they compute (the reference models' module)
    supports: frozenset[Supports] = frozenset()  # the weight views its linears take
    rotary: str = "rot"  # attention blocks: the ``dims`` symbol of the channels rotary turns
    shared: SharedExpert = SharedExpert()  # mixture-of-experts blocks: the shared expert's engine module

    def __post_init__(self) -> None:
        for layout, rows in (("megatron", self.megatron), ("engine", self.engine)):
            for row in rows:  # a kind in a table no layout cuts it for is refused where it is written
                if row.kind.layouts is not None and layout not in row.kind.layouts:
                    raise ValueError(f"row {row.name}: {type(row.kind).__name__} is cut by the "
                                     f"{'/'.join(sorted(row.kind.layouts))} layout only, not in {layout} rows")


@dataclass(frozen=True)
class MtpHead:
    """A multi-token-prediction layer's own tensors around its decoder layer: ``before`` the
    layer (two input norms and the projection of their concatenation) and ``after`` it (the
    output norm).  Engines' serving models hold none of them (their draft models do): their rows
    are empty.  ``head`` / ``layer``: the checkpoint's name prefixes of the head's tensors and of
    the decoder layer's, formatted with ``layer`` (the global index ``L + k``) and ``k``
    (DeepSeek: both ``model.layers.{L+k}.``; Qwen3-Next: ``mtp.`` and ``mtp.layers.{k}.``)."""

    before: Block
    after: Block
    head: str = "model.layers.{layer}."
    layer: str = "model.layers.{layer}."


# -- a family ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Family:
    """One model family: what its HF config holds, how its layers are built, and the flags the
    reference models' forward reads.  ``sections``: the kinds of numbers its specs hold beyond
    the common fields (each reads, writes and checks itself); ``read`` maps a config to common
    ``ModelSpec`` fields it sets its own way, ``write`` the reverse (``None``: nothing beyond);
    ``check`` says which of the family's own rules a spec breaks."""

    name: str
    architecture: str
    attention: Block
    mlp: Block  # dense layers
    moe: Block | None = None  # sparse layers (mixture of experts)
    mtp: MtpHead | None = None  # the checkpoint's MTP layers (``num_nextn_predict_layers``)
    # sparse attention: the block of the layers that reuse the layer before's choice (no indexer)
    shared_attention: Block | None = None
    # hybrids: the block of the linear-attention layers (``section.Linear.linear``)
    linear_attention: Block | None = None
    norm_offset: float = 0.0  # norms scale by (offset + weight): 1.0 for zero-centred ones (Qwen3-Next)
    index_rope_interleaved: bool = False  # the indexer's rotary on neighbouring pairs (GLM-5), else halves
    qkv_bias: bool = False
    qk_norm: bool = False
    post_norms: bool = False  # a norm after attention and after the MLP (GLM4)
    fused_gate_up: bool = False  # gate and up as one checkpoint tensor
    rope_interleaved: bool = False  # rotary on neighbouring channel pairs
    lm_head_every_stage: bool = False  # SGLang 0.5.23 builds an untied lm_head on every PP stage
    sections: tuple[type[Section], ...] = ()  # the numbers its specs hold beyond the common ones
    read: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    write: Callable[[ModelSpec], dict[str, Any]] | None = None
    check: Callable[[ModelSpec], str | None] | None = None  # a family rule a spec breaks, or None
    defaults: dict[str, Any] = field(default_factory=dict)  # preset fields (rms_norm_eps, rope_theta)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def blocks(self, spec: ModelSpec, layer: int) -> tuple[Block, Block]:
        """The attention block and the MLP block of ``layer`` (an MTP layer's decoder layer too)."""
        sparse = self.moe is not None and spec.sparse_layer(layer)
        attention = self.attention
        if self.shared_attention is not None and not spec.section(Indexer).indexed(layer):
            attention = self.shared_attention
        if self.linear_attention is not None and spec.section(Linear).linear(layer, spec.num_layers):
            attention = self.linear_attention
        return attention, (self.moe if sparse and self.moe is not None else self.mlp)
