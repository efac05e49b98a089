"""Which FP8 weights the reference engine multiplies by the FP8 GEMM (``models.fp8_gemm.scaled``):
whole 128 x 128 blocks on Hopper only; on a CPU every FP8 weight is dequantized, as before.
The GEMM's arithmetic runs in ``tests/gpu/test_gpu_fp8_matmul.py``."""

from __future__ import annotations

import torch

from shardsync.models.engine import EngineModel
from shardsync.models.fp8_gemm import TOKENS, scaled
from shardsync.presets import PRESETS
from shardsync.quant.fp8 import Fp8Format, fp8_format


def test_only_whole_blocks_of_the_block_formats() -> None:
    """Formats and shapes are refused before the device is asked (so a CUDA device here, where no
    GPU is, reaches ``get_device_capability`` only if a check is missing: it raises)."""
    cpu, cuda, f = torch.device("cpu"), torch.device("cuda"), fp8_format("fp8")
    assert TOKENS.blocks((5, 256)) == (1, 128) and TOKENS.scale_shape((5, 256)) == (5, 2)
    for fmt, shape in [(fp8_format("fp8-channel"), (256, 256)), (Fp8Format(block=(64, 64)), (256, 256)),
                       (f, (320, 256)), (f, (256, 200)), (f, (4, 256, 256))]:
        assert not scaled(fmt, shape, cuda), (fmt, shape)
    assert not scaled(f, (256, 256), cpu)


def test_a_cpu_engine_dequantizes_every_fp8_weight() -> None:
    model = EngineModel(PRESETS["tiny-qwen3-moe-fp8"], dtype="bfloat16", quantization="fp8")
    assert model.targets and model.gemm_weights() == []
