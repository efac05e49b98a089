"""FP8 rollout weights: the formats engines serve (``fp8``), and the engine tensors a format
quantizes with their scales (``targets``)."""

from shardsync.quant.fp8 import FORMATS, Fp8Format, dequantize, fp8_format, quantize
from shardsync.quant.targets import Target, quantized

__all__ = ["FORMATS", "Fp8Format", "Target", "dequantize", "fp8_format", "quantize", "quantized"]
