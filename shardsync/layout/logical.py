"""Logical tensors: the HuggingFace names and full shapes every layout is expressed in, read
off the family's tables."""

from __future__ import annotations

from shardsync.family.table import PerExpert, dims
from shardsync.spec import ModelSpec


def is_expert(logical: str) -> bool:
    """Whether a logical tensor is one routed expert's (held by expert-parallel ranks)."""
    return ".mlp.experts." in logical


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensors of decoder layer ``layer`` (global index), in checkpoint order."""
    sym, p = dims(spec), f"model.layers.{layer}."
    out: dict[str, tuple[int, ...]] = {}
    for block in spec.family_table.blocks(spec, layer):
        for t in block.logical:
            if isinstance(t, PerExpert):
                for e in range(spec.num_experts):
                    out.update((p + x.name.format(e=e), tuple(sym[s] for s in x.shape))
                               for x in t.tensors if x.when(spec))
            elif t.when(spec):
                out[p + t.name] = tuple(sym[s] for s in t.shape)
    return out


def logical_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the model; a tied ``lm_head`` is not a tensor of its own."""
    V, H = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(spec.num_layers):
        out.update(layer_tensors(spec, layer))
    out["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out
