"""The rollout-engine layout, as SGLang (0.5.x) and vLLM hold a dense model.

Fused ``qkv_proj`` = ``[q (my heads) | k | v (my kv heads)]`` with KV heads replicated
over consecutive ranks when TP exceeds the KV heads; ``gate_up_proj`` = ``[gate_r; up_r]``;
row-parallel ``o_proj``/``down_proj``; vocab padded to 64 (``64*tp`` when that does not
split evenly, SGLang's rule) and split evenly, the tail past the real vocab zero.
Experts (FusedMoE): ``ep`` blocks of ``E/ep`` experts, each split over ``moe_tp = tp/ep``
ranks; rank ``r`` is EP rank ``r // moe_tp`` and MoE-TP rank ``r % moe_tp`` (SGLang's
``--ep-size``; vLLM's ``--enable-expert-parallel`` is ``ep = tp``).  ``w13_weight
[E_loc, 2I/moe_tp, H]`` = per expert ``[gate slice; up slice]``, ``w2_weight [E_loc, H,
I/moe_tp]``; the router ``mlp.gate.weight`` is replicated.  See docs/layouts.md section 2.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardsync.family.cut import Cut, Experts
from shardsync.family.section import Indexer
from shardsync.family.table import Variant
from shardsync.gcpause import gc_paused
from shardsync.layout.base import Layout
from shardsync.layout.cut import cut_rows
from shardsync.layout.full import full_layout
from shardsync.layout.logical import logical_tensors
from shardsync.piece import Piece, RankLayout, Segment, TensorMeta, stacked, whole
from shardsync.spec import ModelSpec


@dataclass(frozen=True, kw_only=True)
class EngineParallel:
    """One rollout engine's parallelism as the trainer plans it, read from the engine at
    connect (never from the trainer's config): TP, expert parallel within it, pipeline
    stages, and ``whole`` for engines whose own loader shards whole tensors."""

    tp: int = 1
    ep: int = 1  # expert parallel within the TP group (moe_tp = tp / ep)
    pp: int = 1  # pipeline stages, each a TP group holding its layers (SGLang --pp-size)
    pp_layers: tuple[int, ...] | None = None  # layers per stage; None: SGLang's even split
    vocab_pad: int = 64
    dtype: str | None = None
    # every rank holds every logical tensor whole and the engine's own loader shards it: for
    # engines whose parameters are not shardsync's engine layout (the always-working layout)
    whole: bool = False
    variants: frozenset[str] = frozenset()  # how this engine's layout departs from the default (ENGINE_VARIANTS)

    def padded_vocab(self, vocab: int) -> int:
        pad = self.vocab_pad
        if (-(-vocab // pad) * pad) % self.tp:
            pad *= self.tp
        return -(-vocab // pad) * pad

    @property
    def world_size(self) -> int:
        """Engine ranks, stage-major: rank ``s * tp + r`` is TP rank ``r`` of stage ``s``."""
        return self.tp * self.pp

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """Stage ``stage``'s layers: ``pp_layers`` (SGLang's SGLANG_PP_LAYER_PARTITION), else
        an even split with one extra layer on each of the last ``num_layers % pp`` stages."""
        if self.pp_layers is not None:
            start = sum(self.pp_layers[:stage])
            return range(start, start + self.pp_layers[stage])
        base, extra = divmod(num_layers, self.pp)
        first_long = self.pp - extra
        start = stage * base + max(0, stage - first_long)
        return range(start, start + base + (stage >= first_long))

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep



# The variant words of an engine layout: what each changes against the default (SGLang's
# names, shared experts apart), and when an engine holds it.
ENGINE_VARIANTS: dict[str, str] = {  # the engine words of ``family.table.Variant``, and what each means
    Variant.SHARED_FUSED.value:
        "the shared expert is expert E of the w13/w2 stacks (SGLang's shared-expert fusion, on by default at EP 1 "
        "on CUDA sm80+; --disable-shared-experts-fusion turns it off)",
    Variant.VLLM.value:
        "vLLM's names (latent attention: fused_qkv_a_proj for SGLang's fused_qkv_a_proj_with_mqa; experts under "
        "mlp.experts.routed_experts; the sparse-attention indexer's wk and weights_proj as one wk_weights_proj)",
    Variant.INDEXER_FUSED.value:
        "the sparse-attention indexer's wk and weights_proj as one bfloat16 wk_weights_proj (SGLang on CUDA when the "
        "indexer's rotary is interleaved: GLM-5; SGLANG_DISABLE_DSA_INDEXER_FUSION=1 turns it off)",
}


def variant_choices(spec: ModelSpec, par: EngineParallel) -> tuple[frozenset[str], ...]:
    """The variant sets an engine like ``par`` may hold ``spec`` in, ``par``'s own first: what a
    host tries its parameters against when they are not the planned layout."""
    toggles = []
    if spec.shared_expert_intermediate_size == spec.moe_intermediate_size > 0 and par.ep == 1:
        toggles.append("shared_fused")
    if spec.find(Indexer) is not None and spec.family_table.index_rope_interleaved and "vllm" not in par.variants:
        toggles.append("indexer_fused")
    choices = [par.variants]
    for word in toggles:
        choices += [c ^ {word} for c in choices]
    return tuple(choices)


def check_engine(spec: ModelSpec, par: EngineParallel) -> None:
    t, ng = par.tp, spec.num_kv_heads
    dense_layers = any(not spec.sparse_layer(n) for n in range(spec.num_layers))
    if min(t, par.ep, par.pp) < 1:  # before any rule divides by them
        raise ValueError(f"engine layout of {spec.name} impossible: tp, ep and pp must be >= 1")
    if par.pp_layers is not None and (len(par.pp_layers) != par.pp or sum(par.pp_layers) != spec.num_layers
                                      or min(par.pp_layers) < 1):
        raise ValueError(f"engine layout of {spec.name} impossible: pp_layers={list(par.pp_layers)} must give each "
                         f"of the {par.pp} stages >= 1 layer, {spec.num_layers} in all")
    if par.pp > spec.num_layers:
        raise ValueError(f"engine layout of {spec.name} impossible: pp={par.pp} exceeds the {spec.num_layers} layers")
    rules = [
        (t >= 1 and par.ep >= 1, "tp and ep must be >= 1"),
        (spec.num_heads % t == 0, f"num_heads={spec.num_heads} not divisible by tp={t}"),
        (ng % t == 0 or t % ng == 0, f"tp={t} must divide or be a multiple of num_kv_heads={ng}"),
        (spec.intermediate_size % t == 0 or not dense_layers,
         f"intermediate_size={spec.intermediate_size} not divisible by tp={t}"),
        *((why is None, why) for why in (sec.tp_refusal(t) for sec in spec.sections)),
    ]
    if spec.is_moe:
        rules += [
            (t % par.ep == 0, f"ep={par.ep} must divide tp={t} (experts are split over the TP group)"),
            (spec.num_experts % par.ep == 0, f"num_experts={spec.num_experts} not divisible by ep={par.ep}"),
            (spec.moe_intermediate_size % max(par.moe_tp, 1) == 0,
             f"moe_intermediate_size={spec.moe_intermediate_size} not divisible by moe_tp = tp/ep = {par.moe_tp}"),
            (spec.shared_expert_intermediate_size % t == 0,
             f"shared_expert_intermediate_size={spec.shared_expert_intermediate_size} not divisible by tp={t}"),
        ]
    else:
        rules.append((par.ep == 1, f"ep={par.ep} applies to mixture-of-experts models only; {spec.name} is dense"))
    unknown = sorted(par.variants - set(ENGINE_VARIANTS))
    rules.append((not unknown, f"unknown layout variants {unknown}; known: {sorted(ENGINE_VARIANTS)}"))
    if "shared_fused" in par.variants:
        rules += [
            (spec.shared_expert_intermediate_size == spec.moe_intermediate_size > 0,
             "shared_fused needs one shared expert of the routed experts' size"),
            (par.ep == 1, f"shared_fused at ep={par.ep}: SGLang fuses the shared expert at EP 1 only (per-rank "
                          "shared slots under DeepEP are not a layout shardsync plans)"),
        ]
    for ok, why in rules:
        if not ok:
            raise ValueError(f"engine layout of {spec.name} impossible: {why}")


def _engine_rank(spec: ModelSpec, par: EngineParallel, stage: int, r: int,
                 logical: dict[str, tuple[int, ...]], dtype: str) -> RankLayout:
    """TP rank ``r`` of stage ``stage``: its layers (global names), the embedding on the first
    stage, the final norm and ``lm_head`` on the last (a tied one there is its own tensor,
    filled from the embedding; a family's ``lm_head_every_stage``: on every stage), as SGLang holds them."""
    t, H, V = par.tp, spec.hidden_size, spec.vocab_size
    tensors: list[TensorMeta] = []
    pieces: list[Piece] = []

    def add(name: str, shape: tuple[int, ...], new: list[Piece], held: tuple[int, ...] | None = None) -> None:
        tensors.append(TensorMeta(name, shape, dtype, held if held != shape else None))
        pieces.extend(new)

    rows = par.padded_vocab(V) // t
    lo, hi = min(r * rows, V), min((r + 1) * rows, V)

    def vocab(name: str, source: str | None = None) -> None:
        src = source or name
        add(name, (rows, H), stacked(name, [Segment(src, lo, hi - lo)], logical, 0) if hi > lo else [])

    first, last = stage == 0, stage == par.pp - 1
    if first:
        vocab("model.embed_tokens.weight")
    experts = Experts(par.ep, r // par.moe_tp, par.moe_tp, r % par.moe_tp)
    for layer in par.stage_layers(spec.num_layers, stage):
        c = Cut(spec, layer, f"model.layers.{layer}.", t, r, logical, variants=par.variants, experts=experts)
        for block in spec.family_table.blocks(spec, layer):
            for made, row_dtype in cut_rows(block.engine, c):
                tensors.append(made.meta(row_dtype or dtype))
                pieces.extend(made.pieces)
    if last:
        add("model.norm.weight", (H,), [whole("model.norm.weight", "model.norm.weight", logical)])
    if spec.tie_word_embeddings:
        if last and not first:
            vocab("lm_head.weight", "model.embed_tokens.weight")
    elif last or spec.family_table.lm_head_every_stage:
        vocab("lm_head.weight")
    return RankLayout(f"pp{stage}tp{r}" if par.pp > 1 else f"tp{r}", tuple(tensors), tuple(pieces))


@gc_paused
def engine_layout(spec: ModelSpec, par: EngineParallel) -> Layout:
    """One engine's layout over its ``par.world_size`` ranks, stage-major (tied models have no
    ``lm_head`` param unless PP puts it on another stage than the embedding)."""
    dtype = par.dtype or spec.dtype
    if par.whole:
        return full_layout(spec, replicas=par.world_size, dtype=dtype)
    check_engine(spec, par)
    logical = logical_tensors(spec)
    ranks = tuple(_engine_rank(spec, par, s, r, logical, dtype) for s in range(par.pp) for r in range(par.tp))
    stages = tuple(len(par.stage_layers(spec.num_layers, s)) for s in range(par.pp))
    params: tuple[tuple[str, object], ...] = ((("tp", par.tp),) + ((("ep", par.ep),) if spec.is_moe else ())
                                              + ((("pp", stages),) if par.pp > 1 else ())
                                              + ((("variants", tuple(sorted(par.variants))),) if par.variants else ()))
    return Layout("engine", spec, logical, ranks, params)
