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

from shardsync.quant.fp8 import E4M3, Fp8Format
from shardsync.runtime.fp8_kernel import quantize_groups

GROUP = 128  # activation columns sharing one scale (1 x 128), as the weight's 128 x 128 blocks
TOKENS = Fp8Format(block=(1, GROUP))  # the activations' format: the block cast per token group
ROWS = 4  # tokens the GEMM takes at a time
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
    group of 128 (the block cast, ``fp8.quantize`` bit for bit: float32 scales ``amax / 448``),
    ``q`` [N, K] e4m3 and ``s`` [N/128, K/128] its block scales, accumulated in float32."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    xq, xs = quantize_activations(flat)
    y = F.scaled_mm(xq, q.t(), xs, F.ScalingType.BlockWise1x128,
                    gemm_scales(s).t(), F.ScalingType.BlockWise128x128, output_dtype=x.dtype)[:flat.shape[0]]
    if bias is not None:
        y = y + bias
    return y.view(*lead, q.shape[0])


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] quantized per token group (``TOKENS``) in one pass into what torch's
    GEMM reads: e4m3 rows padded to whole groups of ``ROWS`` tokens (cuBLAS takes no others,
    seen on an H100; the padding is zero), scales [M', K/128] column-major (one group column
    contiguous; a single column plain, as torch checks it)."""
    m, k = x.shape
    rows, groups = -(-m // ROWS) * ROWS, k // GROUP
    xq = torch.empty(rows, k, dtype=E4M3, device=x.device)
    xs = torch.empty(groups, rows, device=x.device).t() if groups > 1 else torch.empty(rows, 1, device=x.device)
    if rows > m:  # the padding: zero tokens, any finite scale
        xq.view(torch.uint8)[m:].zero_()
        xs[m:].fill_(1.0)
    quantize_groups(x, xq[:m], xs[:m], GROUP)
    return xq, xs


def gemm_scales(s: torch.Tensor) -> torch.Tensor:
    """The weight scales [N/128, K/128] with K/128 padded to a multiple of 4 (torch's layout for
    128 x 128 blocks; the padding is never read)."""
    n, groups = s.shape
    if groups % 4 == 0:
        return s
    out = torch.zeros(n, -(-groups // 4) * 4, dtype=s.dtype, device=s.device)
    out[:, :groups] = s
    return out
