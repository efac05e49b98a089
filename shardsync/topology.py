"""A sync topology: one trainer layout, N engines, and the plans between them.

Everything here is metadata; trainer and engines build the same ``Topology`` from the
same numbers and so derive the same plans (compared by fingerprint at connect time).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property

from shardsync.layout import (
    EngineParallel,
    Layout,
    MegatronParallel,
    RankLayout,
    concat_layouts,
    engine_layout,
    full_layout,
    megatron_layout,
    stage_sources,
)
from shardsync.layout.fsdp2 import Fsdp2Parallel, fsdp2_layout
from shardsync.layout.logical import is_expert, model_tensors
from shardsync.layout.raw import raw_dtypes
from shardsync.lora import (
    Lora,
    engine_adapter_layout,
    fsdp2_adapter_layout,
    full_adapter_layout,
    megatron_adapter_layout,
)
from shardsync.plan import Plan, build_plan
from shardsync.plan.plan import Scaled, dtype_itemsize
from shardsync.quant.fp8 import FORMATS
from shardsync.quant.support import RECEIVER_QUANTIZES
from shardsync.quant.targets import check_family
from shardsync.quant.wire import Derived, Fp8Wire, fp8_wire
from shardsync.spec import ModelSpec

ENGINE_KINDS = ("reference", "sglang", "vllm")
STAGED_KINDS = ("sglang",)  # engine kinds whose ranks receive per pipeline stage
TrainerParallel = MegatronParallel | Fsdp2Parallel
# trainer kind -> its layout (Megatron-core GPTModel shards, or FSDP2 row blocks of HF tensors)
TRAINER_LAYOUTS = {"megatron": megatron_layout, "fsdp2": fsdp2_layout}


@dataclass(frozen=True)
class Topology:
    """A trainer and its engines as metadata: the model, the trainer's parallelism, each
    engine's, and the engine facts read at connect.  Both ends build the same one and derive
    the same layouts, plans and fingerprints from it (cached: a plan is built once)."""

    spec: ModelSpec
    trainer: MegatronParallel | Fsdp2Parallel
    engines: tuple[EngineParallel, ...] = field(default=(EngineParallel(),))
    engine_kind: str = "reference"
    # pipeline depth an engine reports whose layout has no stages (its p2p is refused);
    # engines that host stages (SGLang) carry them in ``EngineParallel.pp`` instead
    engine_pp: int = 1
    quantization: str | None = None
    relay: bool = False
    # a LoRA adapter: the layouts (and so every plan) hold its tensors alone, the base stays put
    lora: Lora | None = None

    @property
    def wire_dtype(self) -> str:
        return self.engines[0].dtype or self.spec.dtype

    @cached_property
    def trainer_base(self) -> Layout:
        """The trainer's own tensors (what its ``params`` hold); ``trainer_layout`` adds the
        tensors an FP8 engine's sends derive from them (``derived``)."""
        if self.lora is not None:
            if isinstance(self.trainer, Fsdp2Parallel):
                return fsdp2_adapter_layout(self.spec, self.lora, self.trainer)
            return megatron_adapter_layout(self.spec, self.lora, self.trainer)
        return TRAINER_LAYOUTS[self.trainer.kind](self.spec, self.trainer)

    @cached_property
    def engine_bases(self) -> tuple[Layout, ...]:
        """Each engine's tensors as it serves them; ``engine_layouts`` as the plans address them
        (an FP8 engine's weights sent quantized as e4m3 words and scales)."""
        lora = self.lora
        unique = {e: engine_layout(self.spec, e) if lora is None else engine_adapter_layout(self.spec, lora, e)
                  for e in dict.fromkeys(self.engines)}
        return tuple(unique[e] for e in self.engines)

    @cached_property
    def fp8(self) -> Fp8Wire | None:
        """The weights an FP8 engine's plans carry as e4m3 bytes and scales, quantized by the
        trainer (``quant.wire``); None where the wire carries the model dtype only."""
        if self.quantization not in FORMATS or self.engine_kind not in RECEIVER_QUANTIZES or self.lora is not None:
            return None  # an FP8 engine's adapter is served wide
        try:
            check_family(self.spec)
        except ValueError:
            return None  # the engine refuses to serve it quantized; nothing to plan
        return fp8_wire(self.trainer_base, self.engine_bases, FORMATS[self.quantization])

    @cached_property
    def _trainer_fp8(self) -> tuple[Layout, tuple[tuple[Derived, ...], ...]]:
        if self.fp8 is None:
            return self.trainer_base, tuple(() for _ in self.trainer_base.ranks)
        return self.fp8.trainer(self.trainer_base)

    @property
    def trainer_layout(self) -> Layout:
        return self._trainer_fp8[0]

    def derived(self, rank: int) -> tuple[Derived, ...]:
        """What trainer ``rank`` quantizes before each send (empty unless ``fp8``)."""
        return self._trainer_fp8[1][rank]

    @cached_property
    def engine_layouts(self) -> tuple[Layout, ...]:
        if self.fp8 is None:
            return self.engine_bases
        unique = {id(lay): self.fp8.retype(lay) for lay in self.engine_bases}
        return tuple(unique[id(lay)] for lay in self.engine_bases)

    def _full(self, **kw) -> Layout:
        """Whole tensors (broadcast receivers), as the wire carries them."""
        if self.lora is not None:
            return full_adapter_layout(self.spec, self.lora, dtype=self.wire_dtype, **kw)
        lay = full_layout(self.spec, dtype=self.wire_dtype, **kw)
        return lay if self.fp8 is None else self.fp8.retype(lay)

    @cached_property
    def scaled(self) -> dict[str, Scaled]:
        """FP8 words -> their block scales, which plans take from the words' holder and buckets
        carry with them (``plan.Scaled``); empty without ``fp8``."""
        return {} if self.fp8 is None else self.fp8.scaled(self.trainer_layout.logical)

    @cached_property
    def raw_dtypes(self) -> dict[str, str]:
        """Logical tensors that move (and are checked) as their own bits: those the trainer
        and every engine hold wider than the wire (``layout/raw.py``; FSDP2 trainers and
        whole-tensor engines hold every tensor in one dtype: none), and FP8 weights' e4m3
        words and scales (``quant.wire``)."""
        quantized = {} if self.fp8 is None else self.fp8.raw
        t = self.trainer
        if not isinstance(t, MegatronParallel) or any(e.whole for e in self.engines) or self.lora is not None:
            return quantized
        per_engine = [raw_dtypes(self.spec, frozenset({t.norm_names}), v, self.wire_dtype)
                      for v in dict.fromkeys(e.variants for e in self.engines)]
        wider = {n: d for n, d in per_engine[0].items() if all(other.get(n) == d for other in per_engine[1:])}
        return {**wider, **quantized}

    @cached_property
    def check_dtypes(self) -> dict[str, str]:
        """The dtype a verify hashes each logical tensor in, where not the wire's: its own for
        the raw ones, and the narrowest an engine holds it in where that is narrower than the
        wire (SGLang's bfloat16 indexer ``weights_proj`` in a float32 sync): the engine holds
        the trainer's value rounded as its own loader rounds it, and is checked so."""
        wire = dtype_itemsize(self.wire_dtype)
        narrow: dict[str, str] = {}
        for lay in self.engine_layouts:
            for rank in lay.ranks:
                held = {t.name: t.dtype for t in rank.tensors if dtype_itemsize(t.dtype) < wire}
                for p in rank.pieces:
                    d = held.get(p.local)
                    if d and dtype_itemsize(d) <= dtype_itemsize(narrow.get(p.logical, d)):
                        narrow[p.logical] = d
        return {**narrow, **self.raw_dtypes}

    @cached_property
    def engine_held(self) -> frozenset[str]:
        """The logical tensors some engine holds (what a sync moves and a verify compares)."""
        return frozenset(p.logical for lay in self.engine_layouts for r in lay.ranks for p in r.pieces)

    @cached_property
    def unsent_bytes(self) -> int:
        """Wire bytes of the logical tensors the trainer holds and no engine does (the MTP
        layers: engines' serving models hold none); they stay on the trainer."""
        mine = {p.logical for r in self.trainer_layout.ranks for p in r.pieces} - self.engine_held
        logical = self.trainer_layout.logical
        return sum(math.prod(logical[n]) for n in mine) * dtype_itemsize(self.wire_dtype)

    @cached_property
    def adapter(self) -> dict[str, int] | None:
        """An adapter sync's sizes: its rank, the adapter's bytes and the base model's (never moved),
        at the wire dtype; None for a whole-model sync."""
        if self.lora is None:
            return None
        size = dtype_itemsize(self.wire_dtype)
        return {"rank": self.lora.rank,
                "adapter_bytes": sum(math.prod(s) for s in self.trainer_layout.logical.values()) * size,
                "base_bytes": sum(math.prod(s) for s in model_tensors(self.spec).values()) * size}

    @cached_property
    def engines_layout(self) -> Layout:
        """All engine ranks as one destination; engine i's ranks follow engine i-1's."""
        return concat_layouts("engine", self.engine_layouts)

    def engine_rank_offset(self, engine: int) -> int:
        return sum(e.world_size for e in self.engines[:engine])

    @property
    def num_engine_ranks(self) -> int:
        return sum(e.world_size for e in self.engines)

    def stage_ranks(self, stage: int) -> list[int]:
        """A stage's broadcast members, its source first (each trainer kind says which)."""
        return self.trainer.broadcast_members(self.spec, stage)

    @cached_property
    def p2p_plan(self) -> Plan:
        """Trainer ranks (all DP replicas) -> engine ranks, shard to shard.

        With ``relay`` only the first engine is a destination; the others receive through
        ``relay_plans`` (engine i -> engine i+1), so the trainer's links carry one copy.
        """
        if self.relay:
            first = concat_layouts("engine", self.engine_layouts[:1])
            return build_plan(self.trainer_layout, first, wire_dtype=self.wire_dtype, raw=self.raw_dtypes,
                              scaled=self.scaled)
        return build_plan(self.trainer_layout, self.engines_layout, wire_dtype=self.wire_dtype, raw=self.raw_dtypes,
                          scaled=self.scaled)

    @cached_property
    def relay_plans(self) -> tuple[Plan, ...]:
        """Engine i -> engine i+1, for a relayed p2p update (empty without ``relay``)."""
        if not self.relay:
            return ()
        return tuple(build_plan(a, b, wire_dtype=self.wire_dtype, raw=self.raw_dtypes, scaled=self.scaled)
                     for a, b in zip(self.engine_layouts, self.engine_layouts[1:], strict=False))

    def fingerprint(self, mode: str) -> str:
        """What trainer and engines compare at connect, per full-update path."""
        if mode == "broadcast":
            return self.broadcast_plan.fingerprint
        if not self.relay_plans:
            return self.p2p_plan.fingerprint
        parts = [self.p2p_plan.fingerprint] + [p.fingerprint for p in self.relay_plans]
        return hashlib.sha256("relay:".join(parts).encode()).hexdigest()[:16]

    @cached_property
    def source_layout(self) -> Layout:
        """Broadcast sources: full tensors on TP rank 0 of DP replica 0 of every stage."""
        return stage_sources(self.trainer_layout,
                             [self.stage_ranks(s) for s in range(self.trainer.pp)])

    @cached_property
    def gather_plan(self) -> Plan:
        """Broadcast step 1: each stage's TP shards -> that stage's source (DP replica 0)."""
        # Only the members take part (other ranks keep their index but hold nothing); members
        # outside DP replica 0 are there for their experts only.
        t, lay = self.trainer, self.trainer_layout

        def kept(i: int, rl: RankLayout) -> RankLayout:
            part = t.primary(self.spec, i)
            if part == "all":
                return rl
            pieces = tuple(p for p in rl.pieces if is_expert(p.logical)) if part == "experts" else ()
            return RankLayout(rl.label, rl.tensors, pieces)

        ranks = tuple(kept(i, rl) for i, rl in enumerate(lay.ranks))
        restricted = Layout(lay.kind, self.spec, lay.logical, ranks, lay.params)
        return build_plan(restricted, self.source_layout, wire_dtype=self.wire_dtype, raw=self.raw_dtypes,
                          scaled=self.scaled)

    @cached_property
    def broadcast_plan(self) -> Plan:
        """Broadcast step 2: each stage source -> whole tensors on every engine rank."""
        receivers = self._full(replicas=self.num_engine_ranks)
        return build_plan(self.source_layout, receivers, wire_dtype=self.wire_dtype, raw=self.raw_dtypes,
                          scaled=self.scaled)

    def narrow_plan(self, engine: int) -> Plan:
        """Broadcast step 3 (rank-local): whole tensors -> engine ``engine``'s shards."""
        return build_plan(self._full(), self.engine_layouts[engine],
                          wire_dtype=self.wire_dtype, raw=self.raw_dtypes, scaled=self.scaled)
