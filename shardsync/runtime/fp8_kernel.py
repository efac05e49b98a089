"""The block quantizer as one GPU pass (Triton): each program reads one block of a bf16 matrix
once and writes its e4m3 bytes and its scale where they are kept, bit for bit ``fp8.quantize``.

``fp8.quantize`` in torch ops reads the matrix about five times (abs, amax, multiply, cast,
copy into the kept words); this reads it once and writes the e4m3 bytes: 3 bytes per element
moved against a bf16 copy's 4.  Counting the bytes that change reads the kept ones too (4 bytes
per element, and the arithmetic that encodes each new byte): asked for, not by default.
Divisions are IEEE-rounded (``div_rn``) as torch's are; the fp32 -> e4m3 conversion is the
hardware's round-to-nearest-even, as torch's.  Block formats with float32 or exponent-bit
(``ue8m0``) scales; others (per channel, vLLM's log2 rounding) take the torch path.  The
same cast per token group of activations (``quantize_groups``, 1 x 128, many rows to a program)
feeds the reference engine's FP8 GEMM (``models.fp8_gemm``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from shardsync.quant.fp8 import AMAX_FLOOR, E4M3_MAX, Fp8Format

_SCALES = {"float32": 0, "ue8m0": 1}
# 1 / 448 rounded to float32: ``amax / E4M3_MAX`` on a CUDA tensor multiplies by it (seen on H100:
# a true division differs in the last bit of some float32 scales)
INV_E4M3_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(E4M3_MAX, dtype=torch.float32))
# warps per 128 x 128 block: fastest measured on an H100 with and without the count (docs/fp8.md)
_WARPS = {False: 4, True: 16}
_GROUP_ROWS = 16  # rows of a program of the per-group cast


def fused(fmt: Fp8Format, w: torch.Tensor) -> bool:
    """Whether ``quantize_into`` takes this weight (a CUDA matrix, a block format it knows)."""
    return w.is_cuda and w.dim() == 2 and fmt.block is not None and fmt.scale in _SCALES


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def block_cast(x_ptr, q_ptr, qb_ptr, s_ptr, n_ptr, r_ptr, N, K, sx0, sx1, sq0, ss0,
                   BM: tl.constexpr, BN: tl.constexpr, UE8M0: tl.constexpr, COUNT: tl.constexpr,
                   ROWS: tl.constexpr, AMAX: tl.constexpr, INV_FMAX: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        src = rows  # the source row of each block row: its own, or where ``r_ptr`` says it starts
        if ROWS:
            src = tl.load(r_ptr + pm) + tl.arange(0, BM)
        x = tl.load(x_ptr + src[:, None] * sx0 + cols[None, :] * sx1, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), AMAX)
        s = amax * INV_FMAX  # torch divides by a scalar as a multiply by its float32 reciprocal
        if UE8M0:
            bits = s.to(tl.int32, bitcast=True)
            e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
            e = tl.minimum(tl.maximum(e, 1), 254)
            s = (e << 23).to(tl.float32, bitcast=True)
        q = (x * tl.math.div_rn(1.0, s)).to(tl.float8e4nv)
        at = rows[:, None] * sq0 + cols[None, :]
        old_s = tl.load(s_ptr + pm * ss0 + pn)
        if COUNT:
            old = tl.load(qb_ptr + at, mask=mask, other=0).to(tl.int32)
            # each new byte encoded from its float value (ptxas of Triton 3.6 dies on sm_90a on a
            # bitcast of e4m3 to integers): sign, then exponent + 7 and 3 mantissa bits, or the
            # subnormal's multiple of 2^-9
            b = q.to(tl.float32).to(tl.int32, bitcast=True)
            a = b & 0x7FFFFFFF
            e8 = (a >> 23) - 127
            normal = ((e8 + 7) << 3) | ((a >> 20) & 7)
            sub = (a.to(tl.float32, bitcast=True) * 512.0).to(tl.int32)
            new = tl.where(e8 >= -6, normal, sub) | ((b >> 24) & 0x80)
            changed = tl.sum(tl.sum(tl.where(mask & (old != new), 1, 0), axis=1), axis=0)
            tl.atomic_add(n_ptr, (changed + (old_s != s).to(tl.int32)).to(tl.int64))
            tl.debug_barrier()  # every thread read the old bytes before any writes the new ones
        tl.store(q_ptr + at, q, mask=mask)
        tl.store(s_ptr + pm * ss0 + pn, s)

    return block_cast


@functools.cache
def _group_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def group_cast(x_ptr, q_ptr, s_ptr, N, K, sx0, sx1, sq0, ss0, ss1,
                   BM: tl.constexpr, BN: tl.constexpr, AMAX: tl.constexpr, INV_FMAX: tl.constexpr):
        pm, pn = tl.program_id(0), tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        mask = (rows[:, None] < N) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * sx0 + cols[None, :] * sx1, mask=mask, other=0.0).to(tl.float32)
        s = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX) * INV_FMAX  # one scale per row's group
        q = (x * tl.math.div_rn(1.0, s)[:, None]).to(tl.float8e4nv)
        tl.store(q_ptr + rows[:, None] * sq0 + cols[None, :], q, mask=mask)
        tl.store(s_ptr + rows * ss0 + pn * ss1, s, mask=rows < N)

    return group_cast


def quantize_groups(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, group: int) -> None:
    """``q``, ``s`` := ``fp8.quantize(x, Fp8Format(block=(1, group)))`` in one pass: one float32
    scale per ``group`` columns of each row (activations per token group), many rows to a
    program (the block kernel would run one program per group).  ``q`` e4m3 with contiguous
    rows, ``s`` any strides.  Queued on the current stream."""
    n, k = x.shape
    if q.stride(1) != 1 or q.dtype != torch.float8_e4m3fn:
        raise ValueError("the e4m3 bytes must have contiguous rows")
    bm = _GROUP_ROWS
    _group_kernel()[(triton_cdiv(n, bm), triton_cdiv(k, group))](
        x, q, s, n, k, x.stride(0), x.stride(1), q.stride(0), s.stride(0), s.stride(1), BM=bm, BN=group,
        AMAX=AMAX_FLOOR, INV_FMAX=INV_E4M3_MAX, num_warps=4)


def quantize_into(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor, fmt: Fp8Format,
                  changed: torch.Tensor | None = None, *, rows: torch.Tensor | None = None) -> None:
    """``q``, ``s`` := ``fp8.quantize(w, fmt)`` in one pass (``q``: e4m3 or its int32 words,
    rows contiguous; ``s``: float32 scales); with ``changed`` (int64, one element, on the
    device) adds to it the e4m3 bytes and scales that changed.  ``rows`` (int32, one per
    block row of ``q``): the matrix is not ``w`` but rows of it, block row ``i`` starting at
    ``w``'s row ``rows[i]`` (Megatron's fused QKV read in place, each part whole blocks).
    Queued on the current stream."""
    if not fused(fmt, w):
        raise ValueError(f"the fused quantizer takes CUDA matrices in block formats; got {fmt.name}, "
                         f"{w.device} {tuple(w.shape)}")
    q8 = q.view(torch.float8_e4m3fn)
    n, k = (w.shape[0] if rows is None else q8.shape[0]), w.shape[1]
    q8 = q8.view(n, k)
    if q8.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError("the kept e4m3 bytes and scales must have contiguous rows")
    if changed is not None and changed.dtype != torch.int64:
        raise ValueError(f"the count of changed bytes is an int64 tensor; got {changed.dtype}")
    assert fmt.block is not None
    bm, bn = fmt.block
    count = changed is not None
    grid = (triton_cdiv(n, bm), triton_cdiv(k, bn))
    if rows is not None and (rows.dtype != torch.int32 or rows.numel() < grid[0]):
        raise ValueError(f"rows names the source row of each of the {grid[0]} block rows (int32)")
    _kernel()[grid](w, q8, q8.view(torch.uint8), s, changed if count else s, s if rows is None else rows, n, k,
                    w.stride(0), w.stride(1), q8.stride(0), s.stride(0), BM=bm, BN=bn, UE8M0=_SCALES[fmt.scale],
                    COUNT=count, ROWS=rows is not None, AMAX=AMAX_FLOOR, INV_FMAX=INV_E4M3_MAX,
                    num_warps=_WARPS[count])


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
