"""The FP8 quantizer (``quant/fp8.py``): DeepGEMM's block cast, whose whole-block shards
quantize to the slices of the whole tensor's result (what lets a rank quantize its own shard).
Bit-equality with SGLang's and vLLM's own functions: ``tests/sglang``, ``tests/vllm``."""

from __future__ import annotations

import pytest
import torch

from shardsync.quant import FORMATS, dequantize, fp8_format, quantize
from shardsync.quant.fp8 import AMAX_FLOOR, E4M3_MAX, ceil_ue8m0

BLOCKED = [f for f in FORMATS.values() if f.block is not None]


def _weight(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(shape[-2], 1, generator=g) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_whole_block_shards_quantize_to_slices_of_the_whole(fmt) -> None:
    w = _weight(384, 512)
    q, s = quantize(w, fmt)
    bm, bn = fmt.blocks(tuple(w.shape))
    for rows in ((0, 128), (128, 384)):
        for cols in ((0, 512), (256, 512)) if fmt.block else ((0, 512),):
            part = w[rows[0]:rows[1], cols[0]:cols[1]]
            pq, ps = quantize(part, fmt)
            assert torch.equal(pq.view(torch.uint8), q[rows[0]:rows[1], cols[0]:cols[1]].view(torch.uint8))
            assert torch.equal(ps, s[rows[0] // bm:rows[1] // bm, cols[0] // bn:cols[1] // bn])


def test_a_shard_that_cuts_a_block_does_not() -> None:
    """Why ``quant.targets`` refuses pieces that are not whole blocks."""
    w = _weight(256, 256)
    w[64:128] *= 40  # the cut half of the first block row holds its largest values
    q, _ = quantize(w, fp8_format("fp8"))
    pq, _ = quantize(w[:64], fp8_format("fp8"))
    assert not torch.equal(pq.view(torch.uint8), q[:64].view(torch.uint8))


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.name)
def test_dequantized_within_e4m3_rounding(fmt) -> None:
    w = _weight(300, 260, seed=3)  # ragged: the last block row and column are partial
    q, s = quantize(w, fmt)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and tuple(s.shape) == fmt.scale_shape((300, 260))
    bm, bn = fmt.blocks((300, 260))
    wide = s.repeat_interleave(bm, 0)[:300].repeat_interleave(bn, 1)[:, :260]
    err = (dequantize(q, s, fmt) - w.float()).abs()
    # 3 mantissa bits: half a unit in the last place is 2^-4 of a normal value; subnormals step 2^-9
    assert bool((err <= w.float().abs() * 2**-4 + wide * 2**-10 + 1e-12).all())
    assert float(q.float().abs().max()) <= E4M3_MAX


def test_scales_are_amax_over_448_or_the_next_power_of_two() -> None:
    w = _weight(256, 256, seed=5)
    amax = w.float().abs().view(2, 128, 2, 128).amax(dim=(1, 3))
    _, s = quantize(w, fp8_format("fp8"))
    assert torch.equal(s, amax / E4M3_MAX)
    _, up = quantize(w, fp8_format("fp8-block128x128-ue8m0"))
    mantissa = up.view(torch.int32) & 0x7FFFFF
    assert bool((mantissa == 0).all()) and bool((up >= s).all()) and bool((up < 2 * s).all())


def test_zero_block_gets_the_floor_scale() -> None:
    q, s = quantize(torch.zeros(128, 128, dtype=torch.bfloat16), fp8_format("fp8"))
    assert not q.float().any() and float(s) == pytest.approx(AMAX_FLOOR / E4M3_MAX)


def test_expert_stacks_quantize_per_expert() -> None:
    w = _weight(3, 256, 128, seed=7)
    q, s = quantize(w, fp8_format("fp8"))
    assert tuple(s.shape) == (3, 2, 1)
    for e in range(3):
        eq, es = quantize(w[e], fp8_format("fp8"))
        assert torch.equal(eq.view(torch.uint8), q[e].view(torch.uint8)) and torch.equal(es, s[e])


def test_the_two_power_of_two_roundings_differ_just_above_a_power_of_two() -> None:
    """DeepGEMM's / SGLang's exponent-bit ceiling vs vLLM's ``2 ** ceil(log2 s)``: log2 of a
    scale one ulp above 2^-10 rounds to -10 exactly, so vLLM keeps 2^-10 where SGLang takes 2^-9."""
    x = torch.tensor([2.0**-10 * (1 + 2.0**-23), 2.0**-10, 0.3])
    assert ceil_ue8m0(x).tolist() == [2.0**-9, 2.0**-10, 0.5]
    assert torch.pow(2.0, torch.ceil(torch.log2(x))).tolist() == [2.0**-10, 2.0**-10, 0.5]


def test_unknown_format_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="fp8-channel"):
        fp8_format("int4")
