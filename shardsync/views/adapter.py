"""A LoRA adapter as a view: every layout holds the adapter's tensors alone (PEFT's names), so
an adapter rides the same plans, paths and checks as a model while the base stays put."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shardsync.layout.base import Layout
from shardsync.layout.engine import EngineParallel
from shardsync.layout.fsdp2 import Fsdp2Parallel
from shardsync.layout.logical import model_tensors
from shardsync.lora import (
    Lora,
    engine_adapter_layout,
    fsdp2_adapter_layout,
    full_adapter_layout,
    megatron_adapter_layout,
)
from shardsync.plan.plan import dtype_itemsize
from shardsync.spec import ModelSpec
from shardsync.units import fmt_bytes
from shardsync.views.base import Bases, BoundView, TrainerParallel, WeightView


@dataclass(frozen=True)
class AdapterView(WeightView):
    """The adapter ``lora`` instead of the base model, on the trainer and on every engine."""

    lora: Lora

    def adapter(self) -> Lora | None:
        return self.lora

    def trainer_base(self, spec: ModelSpec, trainer: TrainerParallel, inner: Callable[[], Layout]) -> Layout:
        if isinstance(trainer, Fsdp2Parallel):
            return fsdp2_adapter_layout(spec, self.lora, trainer)
        return megatron_adapter_layout(spec, self.lora, trainer)

    def engine_base(self, spec: ModelSpec, engine: EngineParallel, inner: Callable[[], Layout]) -> Layout:
        return engine_adapter_layout(spec, self.lora, engine)

    def full_base(self, spec: ModelSpec, dtype: str, replicas: int, inner: Callable[[], Layout]) -> Layout:
        return full_adapter_layout(spec, self.lora, dtype=dtype, replicas=replicas)

    def bind(self, topo: Bases) -> BoundView:
        size = dtype_itemsize(topo.wire_dtype)
        return AdapterBound(self.lora, sum(math.prod(s) for s in topo.trainer_base.logical.values()) * size,
                            sum(math.prod(s) for s in model_tensors(topo.spec).values()) * size)


@dataclass(frozen=True)
class AdapterBound(BoundView):
    """An adapter sync's sizes at the wire dtype: the adapter's bytes and the base's (never moved)."""

    lora: Lora
    adapter_bytes: int
    base_bytes: int

    def raw(self, raw: dict[str, str]) -> dict[str, str]:
        return {}  # the adapter's tensors move in the wire dtype; the base's wider ones never move

    def sizes(self) -> dict[str, int]:
        return {"rank": self.lora.rank, "adapter_bytes": self.adapter_bytes, "base_bytes": self.base_bytes}

    def summary(self, engines: Sequence[Layout], itemsize: int) -> str | None:
        return (f"LoRA adapter of rank {self.lora.rank} alone: {fmt_bytes(self.adapter_bytes)} of a "
                f"{fmt_bytes(self.base_bytes)} base ({self.adapter_bytes / self.base_bytes:.2%}); the base never moves")
