"""Weight views (``base``): FP8 engines (``fp8``) and LoRA adapters (``adapter``) as declared
re-expressions of what a rank holds, composed in one place (``views_of``)."""

from __future__ import annotations

from shardsync.lora import Lora
from shardsync.quant.fp8 import FORMATS, Fp8Format
from shardsync.views.adapter import AdapterBound, AdapterView
from shardsync.views.base import NO_VIEWS, BoundView, BoundViews, Host, Views, WeightView
from shardsync.views.fp8 import Fp8Bound, Fp8View, ServedQuantized


def views_of(quantization: str | Fp8Format | None, lora: Lora | None = None) -> Views:
    """The views a sync composes for engines serving ``quantization`` (a format or its name as the
    engine reports it; None: the model dtype) and ``lora`` (None: the whole model).  An adapter
    is served wide by a quantized engine."""
    name = quantization.name if isinstance(quantization, Fp8Format) else quantization
    if lora is not None:
        return Views((AdapterView(lora),) + (() if name is None else (ServedQuantized(name),)))
    if name is None:
        return Views()
    fmt = FORMATS.get(name)
    return Views((Fp8View(fmt),) if fmt is not None else (ServedQuantized(name),))


__all__ = ["NO_VIEWS", "AdapterBound", "AdapterView", "BoundView", "BoundViews", "Fp8Bound", "Fp8View", "Host",
           "ServedQuantized", "Views", "WeightView", "views_of"]
