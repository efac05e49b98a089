"""An FP8 linear computed in FP8 where the GPU has the kernel: torch's blockwise scaled matmul
(DeepSeek's recipe: 128 x 128 weight blocks, activations quantized per token in groups of 128).

The reference engine computes with what it serves: where this applies, the e4m3 weight and its
``weight_scale_inv`` go into the GEMM as they are, no dequantized copy (what FP8 rollout engines
do with DeepGEMM or CUTLASS); elsewhere (CPU, other GPUs, per channel, shapes that are not whole
blocks) the engine dequantizes.  torch runs this recipe on SM 9.0 (Hopper) only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsync.quant.fp8 import Fp8Format, quantize

GROUP = 128  # activation columns sharing one scale (1 x 128), as the weight's 128 x 128 blocks
TOKENS = Fp8Format(block=(1, GROUP))  # the activations' format: the block cast per token group
_HOPPER = (9, 0)


def scaled(fmt: Fp8Format, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether ``scaled_linear`` computes a weight of ``shape`` held in ``fmt`` on ``device``:
    a matrix of whole 128 x 128 blocks (torch's check: ``N`` and ``K`` multiples of 128), on
    Hopper."""
    return (fmt.block == (GROUP, GROUP) and len(shape) == 2 and not shape[0] % GROUP
            and not shape[1] % GROUP and device.type == "cuda"
            and torch.cuda.get_device_capability(device) == _HOPPER)


def scaled_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (q * s).T (+ bias)`` in ``x``'s dtype, by the FP8 GEMM: ``x`` quantized per token
    group of 128 (the block cast, so float32 scales ``amax / 448``), ``q`` [N, K] e4m3 and ``s``
    [N/128, K/128] its block scales, accumulated in float32 by the kernel."""
    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize(x.reshape(-1, k), TOKENS)
    # torch's layouts: the activation scales outer-dim-major ([M, K/128] with stride (1, M)),
    # the weight column-major ([K, N]) with its scales [K/128, N/128] (the engine's, transposed)
    y = F.scaled_mm(xq, q.t(), xs.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    s.t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*lead, q.shape[0])
