"""The reference engine's FP8 GEMM on a GPU (marked ``gpu``: ``pytest -m gpu``): torch's blockwise
scaled matmul (``models.fp8_gemm``) equals the math it stands for (the per-token-group quantized
activations times the dequantized e4m3 weight, accumulated in float32) to the output's rounding,
and an FP8 engine on Hopper computes its linears with it, near the bf16 engine."""

from __future__ import annotations

import pytest
import torch

from shardsync.models.engine import EngineModel
from shardsync.models.fp8_gemm import TOKENS, scaled, scaled_linear
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS
from shardsync.quant.fp8 import dequantize, fp8_format, quantize
from shardsync.runtime.fp8_kernel import quantize_groups

pytestmark = pytest.mark.gpu
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not HOPPER, reason="torch's blockwise FP8 GEMM runs on SM 9.0 only")
@pytest.mark.parametrize("fmt", ["fp8", "fp8-block128x128-ue8m0"])
@pytest.mark.parametrize("m", [1, 5, 64, 300])
@pytest.mark.parametrize("nk", [(256, 384), (1536, 256), (128, 1024)])
def test_scaled_linear_is_the_block_math(fmt: str, m: int, nk: tuple[int, int]) -> None:
    f, (n, k) = fp8_format(fmt), nk
    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    # rows and columns of different magnitudes: a scale read from the wrong block shows
    w = (torch.randn(n, k, device="cuda", generator=g) * torch.rand(n, 1, device="cuda", generator=g)
         * torch.rand(1, k, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    x = (torch.randn(2, m, k, device="cuda", generator=g) * torch.rand(1, 1, k, device="cuda", generator=g) * 4
         ).to(torch.bfloat16)
    q, s = quantize(w, f)
    assert scaled(f, (n, k), q.device)
    xq, xs = quantize(x.reshape(-1, k), TOKENS)
    ref = (dequantize(xq, xs, TOKENS) @ dequantize(q, s, f).t()).view(2, m, n)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    got = scaled_linear(x, q, s)
    assert got.dtype == torch.bfloat16 and got.shape == (2, m, n)
    err = (got.float() - ref).abs()
    assert float(err.max()) <= float(ref.abs().max()) * 2 ** -7  # bf16's rounding of the largest output
    assert torch.equal(scaled_linear(x, q, s, bias), got + bias)
    # the weight's own product in bf16, for scale: the activation's FP8 is most of the difference
    plain = x.float() @ w.float().t()
    assert float((got.float() - plain).abs().mean()) > float(err.mean())


@pytest.mark.skipif(not HOPPER, reason="torch's blockwise FP8 GEMM runs on SM 9.0 only")
def test_scaled_linear_answers_in_the_activations_dtype() -> None:
    """An engine computing in float32 (the reference engine's default) gets float32 back."""
    f = fp8_format("fp8")
    g = torch.Generator(device="cuda").manual_seed(7)
    q, s = quantize(torch.randn(256, 512, device="cuda", generator=g) * 0.05, f)
    x = torch.randn(3, 512, device="cuda", generator=g)
    y32, y16 = scaled_linear(x, q, s), scaled_linear(x.to(torch.bfloat16), q, s)
    assert y32.dtype == torch.float32 and y16.dtype == torch.bfloat16
    assert float((y32 - y16.float()).abs().max()) <= float(y32.abs().max()) * 2 ** -5  # bf16 inputs


@pytest.mark.parametrize("m", [1, 7, 300])
def test_the_activations_quantize_per_token_group_in_one_pass(m: int) -> None:
    """The per-group kernel, 16 rows to a program, writing its scales column-major (what the
    GEMM reads): ``fp8.quantize`` with 1 x 128 blocks, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(m)
    x = (torch.randn(m, 640, device="cuda", generator=g) * torch.rand(m, 1, device="cuda", generator=g) * 3
         ).to(torch.bfloat16)
    x[0, :128] = 0  # an all-zero group: the floored amax
    q = torch.empty(m, 640, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.full((5, m), -1.0, device="cuda").t()  # [m, 5], one group column contiguous
    quantize_groups(x, q, s, 128)
    ref_q, ref_s = quantize(x, TOKENS)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def test_scaled_takes_whole_blocks_on_hopper_only() -> None:
    f = fp8_format("fp8")
    cuda = torch.device("cuda")
    assert scaled(f, (256, 384), cuda) == HOPPER
    assert not scaled(f, (320, 256), cuda)  # MLA's fused down projection: 320 rows
    assert not scaled(f, (256, 200), cuda)
    assert not scaled(fp8_format("fp8-channel"), (256, 256), cuda)
    assert not scaled(f, (256, 256), torch.device("cpu"))


@pytest.mark.skipif(not HOPPER, reason="torch's blockwise FP8 GEMM runs on SM 9.0 only")
@pytest.mark.parametrize("model", ["tiny-qwen3-fp8", "tiny-qwen3-moe-fp8", "tiny-deepseek-v3-fp8"])
def test_an_fp8_engine_computes_by_the_gemm_near_bf16(model: str) -> None:
    """Log-probabilities of the FP8 engine (GEMM), the FP8 engine dequantizing and the bf16 engine,
    the same random weights on the GPU; the gaps are printed for docs/fp8.md."""
    spec = PRESETS[model]
    source = random_source(spec, seed=0)
    gemm = EngineModel.from_source(spec, source, dtype="bfloat16", device="cuda", quantization="fp8")
    deq = EngineModel.from_source(spec, source, dtype="bfloat16", device="cuda", quantization="fp8",
                                  fp8_gemm=False)
    wide = EngineModel.from_source(spec, source, dtype="bfloat16", device="cuda")
    by_gemm = set(gemm.gemm_weights())
    assert by_gemm <= set(gemm.targets) and not deq.gemm_weights()
    assert "model.layers.1.self_attn.o_proj.weight" in by_gemm
    mlp = "experts.w13_weight" if model != "tiny-qwen3-fp8" else "gate_up_proj.weight"
    assert f"model.layers.1.mlp.{mlp}" in by_gemm
    if model == "tiny-deepseek-v3-fp8":  # 320 rows: not whole blocks, dequantized
        assert "model.layers.1.self_attn.fused_qkv_a_proj_with_mqa.weight" not in by_gemm
    ids = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1)).cuda()
    ref = torch.log_softmax(wide(ids), -1)
    lp_gemm, lp_deq = torch.log_softmax(gemm(ids), -1), torch.log_softmax(deq(ids), -1)
    gap_gemm, gap_deq = (lp_gemm - ref).abs(), (lp_deq - ref).abs()
    between = (lp_gemm - lp_deq).abs()
    print(f"\n{model}: |FP8 GEMM - bf16| mean {float(gap_gemm.mean()):.4f} max {float(gap_gemm.max()):.3f}; "
          f"|FP8 dequantized - bf16| mean {float(gap_deq.mean()):.4f} max {float(gap_deq.max()):.3f}; "
          f"|GEMM - dequantized| mean {float(between.mean()):.4f}")
    assert float(between.mean()) > 0  # the GEMM really ran (activations in FP8 too)
    assert float(gap_gemm.mean()) < 0.08 and float(gap_gemm.max()) < 1.0
