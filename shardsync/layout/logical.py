"""Logical tensors: the HuggingFace names and full shapes every layout is expressed in, read
off the family's tables."""

from __future__ import annotations

import functools

from shardsync.family.table import Block, PerExpert, dims
from shardsync.spec import ModelSpec


def is_expert(logical: str) -> bool:
    """Whether a logical tensor is one routed expert's (held by expert-parallel ranks)."""
    return ".mlp.experts." in logical


def mtp_layers(spec: ModelSpec) -> range:
    """Global indices of the checkpoint's MTP layers (after the decoder's; none without a head)."""
    n = spec.num_nextn_predict_layers if spec.family_table.mtp is not None else 0
    return range(spec.num_layers, spec.num_layers + n)


def hf_prefixes(spec: ModelSpec, layer: int) -> tuple[str, str]:
    """The checkpoint's name prefixes of layer ``layer`` (global index): of its decoder blocks and,
    for an MTP layer, of its head's tensors (``MtpHead.layer`` / ``head``)."""
    head = spec.family_table.mtp
    if layer < spec.num_layers or head is None:
        return f"model.layers.{layer}.", f"model.layers.{layer}."
    k = layer - spec.num_layers
    return head.layer.format(layer=layer, k=k), head.head.format(layer=layer, k=k)


def layer_blocks(spec: ModelSpec, layer: int) -> tuple[tuple[Block, str], ...]:
    """The blocks of layer ``layer`` with their HF name prefixes: its attention and MLP; an MTP
    layer's head around them."""
    inner, outer = hf_prefixes(spec, layer)
    blocks = tuple((b, inner) for b in spec.family_table.blocks(spec, layer))
    head = spec.family_table.mtp
    if layer >= spec.num_layers and head is not None:
        return ((head.before, outer), *blocks, (head.after, outer))
    return blocks


def layer_tensors(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensors of layer ``layer`` (global index; an MTP layer's too), in checkpoint order."""
    sym = dims(spec)
    out: dict[str, tuple[int, ...]] = {}
    for block, p in layer_blocks(spec, layer):
        for t in block.logical:
            if isinstance(t, PerExpert):
                for e in range(spec.num_experts):
                    out.update((p + x.name.format(e=e), tuple(sym[s] for s in x.shape))
                               for x in t.tensors if x.when(spec))
            elif t.when(spec):
                out[p + t.name] = tuple(sym[s] for s in t.shape)
    return out


@functools.lru_cache(maxsize=16)
def logical_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the checkpoint: the model's, then its MTP layers' (a tied
    ``lm_head`` is not a tensor of its own).  Made once per spec and shared by every layout of
    it (0.1 s for a 1T model): never changed in place."""
    out = dict(model_tensors(spec))
    for layer in mtp_layers(spec):
        out.update(layer_tensors(spec, layer))
    return out


@functools.lru_cache(maxsize=16)
def model_tensors(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The logical tensors of the model itself, no MTP layer: what transformers' class and an
    engine's serving model hold (shared like ``logical_tensors``)."""
    V, H = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H)}
    for layer in range(spec.num_layers):
        out.update(layer_tensors(spec, layer))
    out["model.norm.weight"] = (H,)
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = (V, H)
    return out
