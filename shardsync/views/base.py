"""The weight view seam: what a rank holds, re-expressed without touching plans, buckets, the
executor or the transports.

A ``WeightView`` may replace the tensors every layout holds (an adapter's A/B instead of the
base), refuse the shard-level path for the engines at hand, and, once the topology's base
layouts exist, ``bind`` to them: the bound view (``BoundView``) retypes the trainer layout (and
says what each trainer rank derives before a send), retypes each engine layout and the
whole-tensor one, adds the raw dtypes and scale rules the plans carry, and says one line on what
it does.  What execution a view needs lives in the rooms above, in tables from the view's type:
the engine side wraps a host's destination (``receiver.viewed``), the trainer side derives
tensors before a send (``shardsync.viewed``).
``Views`` composes views in order, as torchtitan's model converters are: each hook gets the
previous view's answer.  Every hook defaults to leaving things as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from shardsync.layout.base import Layout
from shardsync.layout.engine import EngineParallel
from shardsync.layout.fsdp2 import Fsdp2Parallel
from shardsync.layout.megatron import MegatronParallel
from shardsync.lora.config import Lora
from shardsync.piece import Box
from shardsync.plan.plan import Rider
from shardsync.quant.wire import Derived
from shardsync.spec import ModelSpec

TrainerParallel = MegatronParallel | Fsdp2Parallel
Derivations = tuple[tuple[Derived, ...], ...]  # per trainer rank: what it derives before a send


@dataclass(frozen=True)
class Host:
    """How the engines of one topology host shardsync's receiver, as their facts say: their kind
    (``reference``, ``sglang``, ``vllm``, or one shardsync does not know) and the pipeline depth
    an engine reports whose layout has no stages (its shard-level path is refused)."""

    kind: str = "reference"
    pp: int = 1


class Bases(Protocol):
    """What a view binds to: a topology's model, engine host, wire dtype and base layouts (the
    tensors the trainer's ``params`` and each engine hold, before any view retyped them)."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def host(self) -> Host: ...

    @property
    def wire_dtype(self) -> str: ...

    @property
    def trainer_base(self) -> Layout: ...

    @property
    def engine_bases(self) -> tuple[Layout, ...]: ...


class BoundView:
    """A view bound to one topology's base layouts: how the plans carry what it re-expresses."""

    def trainer(self, layout: Layout, derived: Derivations) -> tuple[Layout, Derivations]:
        """The trainer layout as the plans read it, and per rank what it derives before a send."""
        return layout, derived

    def engine(self, layout: Layout) -> Layout:
        """An engine's (or the whole-tensor) layout as the plans write it."""
        return layout

    def raw(self, raw: dict[str, str]) -> dict[str, str]:
        """Logical tensors that move as their own bits (``layout/raw.py``), and in which dtype."""
        return raw

    def riders(self, logical: dict[str, Box]) -> dict[str, Rider]:
        """Wire tensors of quantized words -> their block scales, which ride with them (``plan.Rider``)."""
        return {}

    def summary(self, engines: Sequence[Layout], itemsize: int) -> str | None:
        """One line on what the view moves (``shardsync plan``), or None."""
        return None


class WeightView:
    """One declared way of re-expressing the weights a sync moves (see the module)."""

    def trainer_base(self, spec: ModelSpec, trainer: TrainerParallel, inner: Callable[[], Layout]) -> Layout:
        """The tensors the trainer's ``params`` hold (``inner``: what they would be without this view)."""
        return inner()

    def engine_base(self, spec: ModelSpec, engine: EngineParallel, inner: Callable[[], Layout]) -> Layout:
        return inner()

    def full_base(self, spec: ModelSpec, dtype: str, replicas: int, inner: Callable[[], Layout]) -> Layout:
        return inner()

    def refusal(self, spec: ModelSpec, host: Host) -> str | None:
        """Why shard-level syncs cannot serve these engines with this view (None: they can)."""
        return None

    def quantization(self) -> str | None:
        """The quantization an engine serving this view reports in its facts (None: none)."""
        return None

    def adapter(self) -> Lora | None:
        """The adapter an engine serving this view reports, and a sync of it moves alone (None: none)."""
        return None

    def hint(self) -> str | None:
        """What to check first when a trainer's plans and those of an engine serving this view
        disagree (None: nothing of this view's)."""
        return None

    def bind(self, topo: Bases) -> BoundView:
        """This view on the wire of ``topo`` (its base layouts built when first read)."""
        return BoundView()


V = TypeVar("V", bound=WeightView)
W = TypeVar("W", bound=BoundView)
P = TypeVar("P")


@dataclass(frozen=True)
class Views:
    """Views applied in order; the topology's one place where views meet layouts."""

    views: tuple[WeightView, ...] = ()

    def find(self, kind: type[V]) -> V | None:
        """The view of ``kind`` among these (None: not composed here)."""
        return next((v for v in self.views if isinstance(v, kind)), None)

    def trainer_base(self, spec: ModelSpec, trainer: TrainerParallel, inner: Callable[[], Layout]) -> Layout:
        for v in self.views:
            inner = _bound(v.trainer_base, spec, trainer, inner)
        return inner()

    def engine_base(self, spec: ModelSpec, engine: EngineParallel, inner: Callable[[], Layout]) -> Layout:
        for v in self.views:
            inner = _bound(v.engine_base, spec, engine, inner)
        return inner()

    def full_base(self, spec: ModelSpec, dtype: str, replicas: int, inner: Callable[[], Layout]) -> Layout:
        for v in self.views:
            inner = _bound2(v.full_base, spec, dtype, replicas, inner)
        return inner()

    def refusal(self, spec: ModelSpec, host: Host) -> str | None:
        return next((r for v in self.views if (r := v.refusal(spec, host)) is not None), None)

    @property
    def quantization(self) -> str | None:
        """What an engine serving these views reports as its quantization (``InfoResponse``)."""
        return next((q for v in self.views if (q := v.quantization()) is not None), None)

    @property
    def lora(self) -> Lora | None:
        """The adapter these views hold alone (None: the whole model)."""
        return next((a for v in self.views if (a := v.adapter()) is not None), None)

    def hint(self) -> str:
        """The views' hints on a plan disagreement, as a parenthesis ("" if none)."""
        hints = [h for v in self.views if (h := v.hint()) is not None]
        return f" ({'; '.join(hints)})" if hints else ""

    def mismatch(self, synced: Lora | None) -> str | None:
        """Why an engine serving these views refuses a sync of the adapter ``synced`` (None: the
        whole model), or None when it serves exactly that."""
        served = self.lora
        if synced == served:
            return None
        return (f"the trainer syncs {'no adapter' if synced is None else f'adapter {synced}'}, this engine serves "
                f"{'no adapter' if served is None else f'adapter {served}'}")

    def bind(self, topo: Bases) -> BoundViews:
        return BoundViews(tuple(v.bind(topo) for v in self.views))


NO_VIEWS = Views()  # the whole model, as the engine's dtype holds it


def _bound(hook: Callable[[ModelSpec, P, Callable[[], Layout]], Layout], spec: ModelSpec, par: P,
           inner: Callable[[], Layout]) -> Callable[[], Layout]:
    return lambda: hook(spec, par, inner)


def _bound2(hook: Callable[[ModelSpec, str, int, Callable[[], Layout]], Layout], spec: ModelSpec, dtype: str,
            replicas: int, inner: Callable[[], Layout]) -> Callable[[], Layout]:
    return lambda: hook(spec, dtype, replicas, inner)


@dataclass(frozen=True)
class BoundViews(BoundView):
    """Bound views composed in order: itself a ``BoundView``."""

    wires: tuple[BoundView, ...] = ()

    def trainer(self, layout: Layout, derived: Derivations) -> tuple[Layout, Derivations]:
        for w in self.wires:
            layout, derived = w.trainer(layout, derived)
        return layout, derived

    def engine(self, layout: Layout) -> Layout:
        for w in self.wires:
            layout = w.engine(layout)
        return layout

    def raw(self, raw: dict[str, str]) -> dict[str, str]:
        for w in self.wires:
            raw = w.raw(raw)
        return raw

    def riders(self, logical: dict[str, Box]) -> dict[str, Rider]:
        return {k: v for w in self.wires for k, v in w.riders(logical).items()}

    def find(self, kind: type[W]) -> W | None:
        """The bound view of ``kind`` (None: no view bound so)."""
        return next((w for w in self.wires if isinstance(w, kind)), None)

    def summary(self, engines: Sequence[Layout], itemsize: int) -> str | None:
        lines = [s for w in self.wires if (s := w.summary(engines, itemsize)) is not None]
        return "\n".join(lines) or None
