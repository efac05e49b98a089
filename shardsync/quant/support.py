"""Which quantized engines a trainer can sync, and by which path: a table, read at connect
(``control.connect.decide``) and by the p2p preconditions.

- unquantized: every path;
- an FP8 format of ``fp8.FORMATS`` on an engine with shardsync's receiver
  (``RECEIVER_QUANTIZES``): every path; the wire carries e4m3 bytes and scales the trainer
  quantized (``quant.wire``), and the receiver quantizes what arrives wide;
- another quantization the engine's loader applies to full-precision tensors (SGLang's or
  vLLM's online FP8): whole tensors through that loader (broadcast);
- formats whose engines load only checkpoints quantized offline (INT4, MXFP4, NVFP4):
  refused at connect, with the reason.
"""

from __future__ import annotations

from shardsync.quant.fp8 import FORMATS

# engine kinds whose receiver takes FP8 (receiver.quantized): SGLang's into its block-FP8 parameters
RECEIVER_QUANTIZES = frozenset({"reference", "sglang"})

_OFFLINE = ("its engine loads only weights quantized offline (packed low-bit integers or micro-scaled floats), "
            "which shardsync does not produce; serve the rollout engine in bf16 or FP8")
REFUSED: dict[str, str] = {
    "compressed-tensors": f"INT4 W4A16 (compressed-tensors, Kimi-K2's checkpoint): {_OFFLINE}",
    "w4a16": f"INT4 W4A16: {_OFFLINE}",
    "awq": f"AWQ INT4: {_OFFLINE}",
    "gptq": f"GPTQ INT4: {_OFFLINE}",
    "mxfp4": f"MXFP4: {_OFFLINE}",
    "nvfp4": f"NVFP4: {_OFFLINE}",
    "modelopt_fp4": f"NVFP4 (modelopt): {_OFFLINE}",
}


def receiver_quantizes(kind: str, quantization: str | None) -> bool:
    """Shards can land in this engine: unquantized, or an FP8 format its receiver quantizes."""
    return quantization is None or (kind in RECEIVER_QUANTIZES and quantization in FORMATS)


def refusal(quantization: str | None) -> str | None:
    """Why no path can sync an engine quantized this way (None: some path can)."""
    if quantization is None:
        return None
    reason = REFUSED.get(quantization.lower())
    return None if reason is None else f"engines run {quantization} quantization: {reason}"
