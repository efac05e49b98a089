"""A sync topology: one trainer layout, N engines, and the plans between them.

Everything here is metadata; trainer and engines build the same ``Topology`` from the
same numbers and so derive the same plans (compared by fingerprint at connect time).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

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
from shardsync.layout.logical import is_expert
from shardsync.layout.raw import raw_dtypes
from shardsync.lora import Lora
from shardsync.plan import Plan, build_plan
from shardsync.plan.plan import Rider, Wire, dtype_itemsize
from shardsync.quant.wire import Derived, Fp8Wire
from shardsync.spec import ModelSpec
from shardsync.views import AdapterBound, BoundViews, Fp8Bound, Host, Views

ENGINE_KINDS = ("reference", "sglang", "vllm")
STAGED_KINDS = ("sglang",)  # engine kinds whose ranks receive per pipeline stage
TrainerParallel = MegatronParallel | Fsdp2Parallel
# trainer kind -> its layout (Megatron-core GPTModel shards, or FSDP2 row blocks of HF tensors)
TRAINER_LAYOUTS: dict[str, Callable[[ModelSpec, Any], Layout]] = {"megatron": megatron_layout,
                                                                  "fsdp2": fsdp2_layout}


@dataclass(frozen=True)
class Topology:
    """A trainer and its engines as metadata: the model, the trainer's parallelism, each
    engine's, and the engine facts read at connect.  Both ends build the same one and derive
    the same layouts, plans and fingerprints from it (cached: a plan is built once)."""

    spec: ModelSpec
    trainer: MegatronParallel | Fsdp2Parallel
    engines: tuple[EngineParallel, ...] = field(default=(EngineParallel(),))
    # what the layouts re-express (an FP8 engine's words and scales, an adapter alone), in order
    views: Views = field(default_factory=Views)
    relay: bool = False
    host: Host = field(default_factory=Host)  # how the engines host the receiver: their kind, reported PP

    @property
    def wire_dtype(self) -> str:
        return self.engines[0].dtype or self.spec.dtype

    @cached_property
    def trainer_base(self) -> Layout:
        """The trainer's own tensors (what its ``params`` hold); ``trainer_layout`` adds the
        tensors the views derive from them before a send (``derived``)."""
        return self.views.trainer_base(self.spec, self.trainer,
                                       lambda: TRAINER_LAYOUTS[self.trainer.kind](self.spec, self.trainer))

    @cached_property
    def engine_bases(self) -> tuple[Layout, ...]:
        """Each engine's tensors as it serves them; ``engine_layouts`` as the plans address them
        (an FP8 engine's weights sent quantized as e4m3 words and scales)."""
        def base(e: EngineParallel) -> Layout:
            return self.views.engine_base(self.spec, e, lambda: engine_layout(self.spec, e))

        unique = {e: base(e) for e in dict.fromkeys(self.engines)}
        return tuple(unique[e] for e in self.engines)

    @cached_property
    def bound(self) -> BoundViews:
        """The views bound to this topology's base layouts: how its plans carry them."""
        return self.views.bind(self)

    @property
    def fp8(self) -> Fp8Wire | None:
        """The weights an FP8 engine's plans carry as e4m3 bytes and scales, quantized by the
        trainer (``quant.wire``); None where the wire carries the model dtype only."""
        hit = self.bound.find(Fp8Bound)
        return None if hit is None else hit.wire

    @property
    def lora(self) -> Lora | None:
        """The adapter every layout holds alone (None: the whole model)."""
        return self.views.lora

    @cached_property
    def _trainer_views(self) -> tuple[Layout, tuple[tuple[Derived, ...], ...]]:
        return self.bound.trainer(self.trainer_base, tuple(() for _ in self.trainer_base.ranks))

    @property
    def trainer_layout(self) -> Layout:
        return self._trainer_views[0]

    def derived(self, rank: int) -> tuple[Derived, ...]:
        """What trainer ``rank`` derives before each send (an FP8 engine's words and scales)."""
        return self._trainer_views[1][rank]

    @cached_property
    def engine_layouts(self) -> tuple[Layout, ...]:
        unique = {id(lay): self.bound.engine(lay) for lay in self.engine_bases}
        return tuple(unique[id(lay)] for lay in self.engine_bases)

    def _full(self, replicas: int = 1) -> Layout:
        """Whole tensors (broadcast receivers), as the wire carries them."""
        dtype = self.wire_dtype
        lay = self.views.full_base(self.spec, dtype, replicas,
                                   lambda: full_layout(self.spec, dtype=dtype, replicas=replicas))
        return self.bound.engine(lay)

    @cached_property
    def riders(self) -> dict[str, Rider]:
        """Wire words -> their block scales, which plans take from the words' holder and buckets
        carry with them (``plan.Rider``); empty unless a view quantizes."""
        return self.bound.riders(self.trainer_layout.logical)

    @cached_property
    def raw_dtypes(self) -> dict[str, str]:
        """Logical tensors that move (and are checked) as their own bits: those the trainer
        and every engine hold wider than the wire (``layout/raw.py``; FSDP2 trainers and
        whole-tensor engines hold every tensor in one dtype: none), and what the views add
        (an FP8 engine's e4m3 words and scales; an adapter moves none)."""
        t = self.trainer
        if not isinstance(t, MegatronParallel) or any(e.whole for e in self.engines):
            return self.bound.raw({})
        per_engine = [raw_dtypes(self.spec, frozenset({t.norm_names}), v, self.wire_dtype)
                      for v in dict.fromkeys(e.variants for e in self.engines)]
        wider = {n: d for n, d in per_engine[0].items() if all(other.get(n) == d for other in per_engine[1:])}
        return self.bound.raw(wider)

    @cached_property
    def wire(self) -> Wire:
        """What every plan of this topology carries besides its layouts."""
        return Wire(self.wire_dtype, self.raw_dtypes, self.riders)

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

    @property
    def adapter(self) -> dict[str, int] | None:
        """An adapter sync's sizes: its rank, the adapter's bytes and the base model's (never moved),
        at the wire dtype; None for a whole-model sync."""
        hit = self.bound.find(AdapterBound)
        return None if hit is None else hit.sizes()

    def summary(self) -> str | None:
        """What the views move, in a line each (``shardsync plan``)."""
        return self.bound.summary(self.engine_layouts, dtype_itemsize(self.wire_dtype))

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
            return build_plan(self.trainer_layout, first, self.wire)
        return build_plan(self.trainer_layout, self.engines_layout, self.wire)

    @cached_property
    def relay_plans(self) -> tuple[Plan, ...]:
        """Engine i -> engine i+1, for a relayed p2p update (empty without ``relay``)."""
        if not self.relay:
            return ()
        return tuple(build_plan(a, b, self.wire)
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
        return build_plan(restricted, self.source_layout, self.wire)

    @cached_property
    def broadcast_plan(self) -> Plan:
        """Broadcast step 2: each stage source -> whole tensors on every engine rank."""
        receivers = self._full(replicas=self.num_engine_ranks)
        return build_plan(self.source_layout, receivers, self.wire)

    def narrow_plan(self, engine: int) -> Plan:
        """Broadcast step 3 (rank-local): whole tensors -> engine ``engine``'s shards."""
        return build_plan(self._full(), self.engine_layouts[engine], self.wire)
