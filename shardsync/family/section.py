"""A spec's own sections: the numbers only some models have (latent attention's ranks, a
sparse-attention indexer, linear attention's heads), beyond the fields every decoder shares.

A ``Section`` reads itself from a HuggingFace config, writes itself back, names the ``dims``
symbols its rows are written in and the rule a spec breaks; a family declares the sections its
specs hold (``Family.sections``), and a new family declares a new section in its own module
with no change to ``ModelSpec``.  Field names are the config's (``kv_lora_rank``), so a reader
of a ``config.json`` finds them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class Section:
    """Numbers a family's specs hold beyond the common ones.  ``key``: its name in a spec's
    JSON (``ModelSpec.to_dict``)."""

    key: ClassVar[str]

    @classmethod
    def read(cls, cfg: dict[str, Any]) -> Section:
        """The section of a HuggingFace ``config.json`` dict (the config's own field names)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in cfg.items() if k in names})

    def write(self, spec: ModelSpec) -> dict[str, Any]:
        """The config fields ``transformers`` (and the engines) read it back from."""
        return dataclasses.asdict(self)

    def dims(self, spec: ModelSpec) -> dict[str, int]:
        """The ``dims`` symbols of its rows' shapes."""
        return {}

    def check(self, spec: ModelSpec) -> str | None:
        """A rule of its own that ``spec`` breaks, or None."""
        return None

    def tp_refusal(self, tp: int) -> str | None:
        """Why an engine of tensor parallel ``tp`` cannot split its tensors, or None."""
        return None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Section:
        """The section of its JSON (``dataclasses.asdict``), refusing fields it does not have."""
        refuse_unknown(cls, d, f"{cls.key} section fields")
        return cls(**d)


S = TypeVar("S", bound=Section)


def refuse_unknown(record: type, d: dict[str, Any], what: str) -> None:
    """Refuse the keys of a peer's JSON ``d`` that are no field of the dataclass ``record``."""
    names = {f.name for f in dataclasses.fields(record)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}; known: {sorted(names)}")


@dataclass(frozen=True)
class Latent(Section):
    """Multi-head latent attention (DeepSeek-V3 naming): the query's down rank (None: ``q_proj``
    straight from the hidden state), the kv latent rank, a head's no-rope and rope widths, and
    the value head width.  ``head_dim`` is then nope + rope and ``num_kv_heads`` the heads."""

    key: ClassVar[str] = "latent"
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    def dims(self, spec: ModelSpec) -> dict[str, int]:
        h = spec.num_heads
        # q down rank, kv latent rank, kv down rows (latent + rope), kv up rows (heads x (nope + v)),
        # attention output, MLA's rotary channels
        return {"ql": self.q_lora_rank or 0, "kl": self.kv_lora_rank, "kva": self.kv_lora_rank + self.qk_rope_head_dim,
                "kvb": h * (self.qk_nope_head_dim + self.v_head_dim), "hv": h * self.v_head_dim,
                "rope": self.qk_rope_head_dim}

    def check(self, spec: ModelSpec) -> str | None:
        if not (self.kv_lora_rank > 0 and min(self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim) > 0
                and spec.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim
                and (self.q_lora_rank is None or self.q_lora_rank > 0)):
            return ("latent attention needs positive kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and "
                    "v_head_dim, head_dim = nope + rope, and q_lora_rank None or > 0")
        return None


@dataclass(frozen=True)
class Indexer(Section):
    """DeepSeek sparse attention's lightning indexer (DeepSeek-V3.2, GLM-5): its heads, head
    width and the keys each query keeps; ``index_shared_layers`` reuse the layer before's choice
    and hold no indexer (GLM-5's ``indexer_types`` "shared")."""

    key: ClassVar[str] = "indexer"
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    index_shared_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "index_shared_layers", tuple(self.index_shared_layers))  # JSON gives a list

    @classmethod
    def read(cls, cfg: dict[str, Any]) -> Indexer:
        """GLM-5 may mark layers ``shared``: ``indexer_types``, or transformers' schedule from
        ``index_topk_freq`` / ``index_skip_topk_offset`` (every layer full by default)."""
        layers = cfg["num_hidden_layers"]
        kinds = cfg.get("indexer_types")
        if kinds is None:
            freq, offset = max(cfg.get("index_topk_freq") or 1, 1), cfg.get("index_skip_topk_offset", 2)
            kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        unknown = sorted(set(kinds) - {"full", "shared"})
        if unknown or len(kinds) != layers:
            raise ValueError(f"indexer_types must name each of the {layers} layers 'full' or 'shared' (got {kinds})")
        if kinds and kinds[0] == "shared":
            raise ValueError("indexer_types: the first layer must be 'full' (a shared layer reuses the one before)")
        return cls(cfg["index_n_heads"], cfg["index_head_dim"], cfg["index_topk"],
                   tuple(i for i, kind in enumerate(kinds) if kind == "shared"))

    def write(self, spec: ModelSpec) -> dict[str, Any]:
        shared = set(self.index_shared_layers)
        return {"index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
                "index_topk": self.index_topk,
                "indexer_types": ["shared" if i in shared else "full" for i in range(spec.num_layers)]}

    def dims(self, spec: ModelSpec) -> dict[str, int]:
        # query rows (heads x head width), key width, heads
        return {"iq": self.index_n_heads * self.index_head_dim, "id": self.index_head_dim, "ih": self.index_n_heads}

    def check(self, spec: ModelSpec) -> str | None:
        latent = spec.find(Latent)
        if not (self.index_n_heads > 0 and self.index_topk > 0 and latent is not None and latent.q_lora_rank
                and latent.qk_rope_head_dim <= self.index_head_dim):
            return ("sparse attention needs positive index_n_heads and index_topk, latent attention with a "
                    "q_lora_rank (the indexer reads the query's latent) and index_head_dim >= qk_rope_head_dim")
        if 0 in self.index_shared_layers or any(not 0 <= i < spec.num_layers for i in self.index_shared_layers):
            return "index_shared_layers must be layers after the first"
        return None

    def indexed(self, layer: int) -> bool:
        """Whether ``layer`` runs (and holds) its own indexer."""
        return layer not in self.index_shared_layers


@dataclass(frozen=True)
class Linear(Section):
    """Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): every ``full_attention_interval``-th layer
    attends fully, the others are linear attention with these key/value heads and widths and a
    causal conv of ``linear_conv_kernel_dim``."""

    key: ClassVar[str] = "linear"
    full_attention_interval: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @classmethod
    def read(cls, cfg: dict[str, Any]) -> Linear:
        """SGLang reads only ``full_attention_interval`` (its ``layers_block_type``); a
        ``layer_types`` that no interval gives is refused rather than served differently."""
        layers = cfg["num_hidden_layers"]
        interval = cfg.get("full_attention_interval") or 4
        kinds = cfg.get("layer_types")
        if kinds is not None:
            full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
            interval = full[0] + 1 if full else 0
            want = ["full_attention" if interval and (i + 1) % interval == 0 else "linear_attention"
                    for i in range(layers)]
            if list(kinds) != want:
                raise ValueError("layer_types must be full attention on every n-th layer and linear attention "
                                 f"elsewhere (SGLang reads full_attention_interval only); got {kinds}")
        return cls(interval, cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                   cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"])

    def write(self, spec: ModelSpec) -> dict[str, Any]:
        kinds = ["linear_attention" if self.linear(i, spec.num_layers) else "full_attention"
                 for i in range(spec.num_layers)]
        return {**dataclasses.asdict(self), "layer_types": kinds}

    def dims(self, spec: ModelSpec) -> dict[str, int]:
        """Key rows (heads x key dim), value rows, the fused checkpoint projections' rows, the conv
        channels ([q | k | v]), value heads, a value head's width, the conv kernel."""
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        dk, dv = self.linear_key_head_dim, self.linear_value_head_dim
        return {"lq": nk * dk, "2lq": 2 * nk * dk, "lvd": nv * dv, "lqkvz": 2 * nk * dk + 2 * nv * dv, "lba": 2 * nv,
                "lconv": 2 * nk * dk + nv * dv, "lnv": nv, "ldv": dv, "lkern": self.linear_conv_kernel_dim}

    def check(self, spec: ModelSpec) -> str | None:
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        if not (self.full_attention_interval > 0 and nk > 0 and nv % nk == 0 and self.linear_key_head_dim > 0
                and self.linear_value_head_dim > 0 and self.linear_conv_kernel_dim > 0):
            return ("a gated DeltaNet hybrid needs full_attention_interval > 0, positive linear head counts and dims "
                    "(value heads a multiple of key heads) and a conv kernel")
        return None

    def tp_refusal(self, tp: int) -> str | None:
        nk, nv = self.linear_num_key_heads, self.linear_num_value_heads
        if nk % tp or nv % tp:
            return (f"linear attention's key heads ({nk}) and value heads ({nv}) must be divisible by tp={tp} "
                    "(SGLang and vLLM split them by heads)")
        return None

    def linear(self, layer: int, num_layers: int) -> bool:
        """Whether ``layer`` is a linear-attention layer (an MTP layer, past ``num_layers``,
        attends fully)."""
        return (layer + 1) % self.full_attention_interval != 0 and layer < num_layers
