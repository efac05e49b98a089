"""FP8 engines against SGLang's own: its quantizer (``per_block_cast_to_fp8``, DeepGEMM's, with
power-of-two scales) equals ``quant.fp8`` bit for bit, and SGLang's Qwen3 / Qwen3-MoE / DeepSeek-V3 classes
built with its block FP8 config (``Fp8Config``, 128 x 128) on CPU, loading a checkpoint that
SGLang's quantizer made from the full bf16 tensors through SGLang's own ``load_weights``, hold
exactly the tensors a shardsync FP8 engine rank holds: the names, shapes and dtypes of
``quant.targets`` and, bit for bit, the e4m3 weights and scales a receiver quantizes from its
shard (``receiver.quantized``) and a trainer from its own (``quant.wire``), at TP 1, 2 and 4 and
EP 2 (DeepSeek's MLA at TP 1 and 2)."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format, quantize, quantized
from tests.sglang import _models

FMT = fp8_format("fp8-block128x128-ue8m0")  # SGLang's pure-torch quantizer rounds scales up to powers of two


def _weight(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(shape[-2], 1, generator=g) * 0.1).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (128, 128)])
def test_quantizer_equals_sglang_per_block_cast(shape: tuple[int, int]) -> None:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    w = _weight(*shape, seed=sum(shape))
    theirs_q, theirs_s = per_block_cast_to_fp8(w)
    q, s = quantize(w, FMT)
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)) and torch.equal(s, theirs_s)


def test_quantizer_equals_sglang_expert_stacks() -> None:
    from sglang.srt.layers.quantization.fp8_utils import quant_weight_ue8m0

    w = _weight(4, 256, 384, seed=4)
    theirs_q, theirs_s = quant_weight_ue8m0(w, [128, 128])
    q, s = quantize(w, FMT)
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)) and torch.equal(s, theirs_s)


def _checkpoint(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint as SGLang's quantizer makes it: every linear weight in e4m3 with its scale."""
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    out = {}
    for name, t in full.items():
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and t.dim() == 2:
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = per_block_cast_to_fp8(t)
        else:
            out[name] = t
    return out


# What SGLang's DeepSeek attention derives from ``kv_b_proj`` and its block scales after a load
# (``post_load_weights``): the absorbed key and value weights re-quantized per tensor, and that
# scale.  Not parameters: a load through the parameters alone leaves them stale, so an FP8
# SGLang host must recompute them after every sync (docs/fp8.md; the host refuses FP8 so far).
MLA_DERIVED = ("w_kc", "w_vc", "w_scale")

WORLDS = [("tiny-qwen3-fp8", tp, 1) for tp in (1, 2, 4)] + \
         [("tiny-qwen3-moe-fp8", tp, ep) for tp, ep in ((1, 1), (2, 1), (4, 1), (2, 2))] + \
         [("tiny-deepseek-v3-fp8", tp, ep) for tp, ep in ((1, 1), (2, 1), (2, 2))]


@pytest.mark.parametrize(("model", "tp", "ep"), WORLDS, ids=lambda v: str(v))
def test_sglang_fp8_classes_hold_what_a_shardsync_fp8_rank_quantizes(model: str, tp: int, ep: int) -> None:
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    spec = PRESETS[model]
    seeded = random_source(spec, seed=11)
    full = {n: seeded(n).to(torch.bfloat16) for n in logical_tensors(spec)}
    ckpt = _checkpoint(full)
    config = Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    lay = engine_layout(spec, EngineParallel(tp=tp, ep=ep, dtype="bfloat16"))
    for rank in range(tp):
        m = _models.build(_models.hf_config(spec), rank, tp, torch.bfloat16, ep_size=ep, quant_config=config)
        _models.sglang_load(m, ckpt)
        # SGLang's FP8 config gives MLA's attention KV-cache scales (``attn_mha.k_scale`` ...): 1.0
        # unless a checkpoint carries them, the FP8 KV cache's, not weights; nothing syncs them
        theirs = {n: p for n, p in m.named_parameters() if not n.endswith((".k_scale", ".v_scale"))}
        targets = quantized(lay.ranks[rank], spec, FMT)
        shard = load_rank(lay, rank, lambda n: full[n])
        mine: dict[str, torch.Tensor] = {}
        for t in lay.ranks[rank].tensors:
            target = targets.get(t.name)
            if target is None:
                mine[t.name] = shard[t.name].view(t.stored)
            else:
                mine[t.name], mine[target.scale] = quantize(shard[t.name].view(target.shape), FMT)
        assert {n: (tuple(p.shape), p.dtype) for n, p in theirs.items()} == \
               {n: (tuple(p.shape), p.dtype) for n, p in mine.items()}, (tp, ep, rank)
        bad = [n for n, p in theirs.items()
               if not torch.equal(p.data.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.data,
                                  mine[n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else mine[n])]
        assert bad == [], (tp, ep, rank, bad[:4])
        assert len(targets) > 0
        if spec.q_lora_rank is not None:  # MLA: state SGLang derives after loading, beside the parameters
            attn = m.model.layers[1].self_attn
            assert all(getattr(attn, n) is not None for n in MLA_DERIVED), MLA_DERIVED
            assert attn.w_kc.dtype == torch.float8_e4m3fn
