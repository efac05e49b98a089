"""FP8 engines as a view: the plans carry each quantized weight as e4m3 words and block scales
that the trainer rank holding the blocks quantizes (``quant.wire``), and the engine quantizes
what arrives wide.  The only place an FP8 topology's layouts are retyped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shardsync.layout.base import Layout
from shardsync.piece import Box
from shardsync.plan.plan import Rider
from shardsync.quant.fp8 import FORMATS, Fp8Format
from shardsync.quant.support import RECEIVER_QUANTIZES, receiver_quantizes
from shardsync.quant.targets import check_family
from shardsync.quant.wire import Fp8Wire, fp8_wire
from shardsync.spec import ModelSpec
from shardsync.views.base import Bases, BoundView, Derivations, Host, WeightView


@dataclass(frozen=True)
class Fp8View(WeightView):
    """Engines serving ``fmt``.  Engines whose receiver does not quantize (vLLM) or a family
    outside the FP8 table leave the wire as it is: the first refuses shard-level syncs (whole
    tensors through the engine's own loader), the second the engine itself refuses to serve."""

    fmt: Fp8Format

    def refusal(self, spec: ModelSpec, host: Host) -> str | None:
        return _refusal(self.fmt.name, host)

    def quantization(self) -> str | None:
        return self.fmt.name

    def hint(self) -> str | None:
        return _hint(self.fmt.name)

    def bind(self, topo: Bases) -> BoundView:
        if topo.host.kind not in RECEIVER_QUANTIZES:
            return BoundView()
        try:
            check_family(topo.spec)
        except ValueError:
            return BoundView()  # the engine refuses to serve it quantized; nothing to plan
        return Fp8Bound(fp8_wire(topo.trainer_base, topo.engine_bases, self.fmt))


def _hint(quantization: str) -> str:
    return (f"this engine serves {quantization}: the trainer plans FP8 when the engine reports it, "
            "e.g. SGLang started with --quantization fp8")


def _refusal(quantization: str, host: Host) -> str | None:
    if receiver_quantizes(host.kind, quantization):
        return None
    return (f"engines of kind {host.kind} serving {quantization} take whole tensors through their own loader; "
            f"shardsync's receiver quantizes shards in {sorted(RECEIVER_QUANTIZES)} engines, formats {sorted(FORMATS)}")


@dataclass(frozen=True)
class ServedQuantized(WeightView):
    """Engines serving ``name`` where the wire carries the model dtype: a quantization their own
    loader applies to whole tensors (vLLM's online FP8, SGLang's others), or an FP8 engine's
    adapter (served wide).  Shard-level syncs are refused unless the receiver quantizes."""

    name: str

    def refusal(self, spec: ModelSpec, host: Host) -> str | None:
        return _refusal(self.name, host)

    def quantization(self) -> str | None:
        return self.name

    def hint(self) -> str | None:
        return _hint(self.name)


@dataclass(frozen=True)
class Fp8Bound(BoundView):
    """``wire``: the weights sent quantized whole, those cut into cells, and how layouts hold them."""

    wire: Fp8Wire

    def trainer(self, layout: Layout, derived: Derivations) -> tuple[Layout, Derivations]:
        return self.wire.trainer(layout)

    def engine(self, layout: Layout) -> Layout:
        return self.wire.retype(layout)

    def raw(self, raw: dict[str, str]) -> dict[str, str]:
        return {**raw, **self.wire.raw}

    def riders(self, logical: dict[str, Box]) -> dict[str, Rider]:
        return self.wire.riders(logical)

    def summary(self, engines: Sequence[Layout], itemsize: int) -> str | None:
        return self.wire.summary(engines, itemsize)
