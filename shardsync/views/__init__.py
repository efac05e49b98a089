"""Weight views (``base``): FP8 engines (``fp8``) and LoRA adapters (``adapter``) as declared
re-expressions of what a rank holds, composed in one place (``views_of``)."""

from __future__ import annotations

from shardsync.lora import Lora
from shardsync.quant.fp8 import FORMATS
from shardsync.views.adapter import AdapterBound, AdapterView
from shardsync.views.base import BoundView, BoundViews, Host, Views, WeightView
from shardsync.views.fp8 import Fp8Bound, Fp8View, ServedQuantized


def views_of(quantization: str | None, lora: Lora | None = None) -> Views:
    """The views a sync composes for engines serving ``quantization`` (None: the model dtype) and
    ``lora`` (None: the whole model).  An adapter is served wide by a quantized engine."""
    if lora is not None:
        return Views((AdapterView(lora),) + (() if quantization is None else (ServedQuantized(quantization),)))
    if quantization is None:
        return Views()
    fmt = FORMATS.get(quantization)
    return Views((Fp8View(fmt),) if fmt is not None else (ServedQuantized(quantization),))


__all__ = ["AdapterBound", "AdapterView", "BoundViews", "Fp8Bound", "Fp8View", "Host", "ServedQuantized", "Views",
           "WeightView", "BoundView", "views_of"]
