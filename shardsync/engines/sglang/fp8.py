"""What an SGLang model serving FP8 holds, and whether shardsync can write it in place.

SGLang's ``Fp8Config`` with 128 x 128 blocks (the DeepSeek-V3 / Qwen3 FP8 checkpoints) keeps
each linear's e4m3 weight and float32 ``weight_scale_inv`` as parameters in shardsync's FP8
engine layout (``quant.targets``; ``tests/sglang/test_sglang_fp8.py``), so a receive writes
the e4m3 bytes and scales the trainer quantized straight into them.  Some SGLang set-ups
derive other state from those parameters after a load, which an in-place write would leave
stale; each is refused here by name (``REFUSALS``) rather than served half-updated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from shardsync.piece import RankLayout
from shardsync.quant import quantized
from shardsync.quant.fp8 import Fp8Format, fp8_format
from shardsync.quant.targets import Target
from shardsync.spec import ModelSpec
from shardsync.views import NO_VIEWS, Views, views_of

# parameters SGLang's FP8 config adds that are not weights: the FP8 KV cache's scales (1.0
# unless a checkpoint carries them); nothing syncs them
KV_CACHE_SCALES = (".k_scale", ".v_scale")


class Served:
    """What an SGLang rank's parameters serve: the views a sync into them composes, and what a
    check of the live parameters compares and skips.  This base: the model dtype."""

    fmt: Fp8Format | None = None
    views: Views = NO_VIEWS
    skip: tuple[str, ...] = ()

    def targets(self, rank: RankLayout, spec: ModelSpec) -> dict[str, Target] | None:
        """The rank's tensors SGLang holds quantized (``quant.quantized``; None: none)."""
        return None

    def __str__(self) -> str:
        return ""


@dataclass(frozen=True)
class ServedFp8(Served):
    """Parameters in the FP8 format ``fmt``: e4m3 weights and their scales, written in place."""

    fmt: Fp8Format
    skip: tuple[str, ...] = KV_CACHE_SCALES

    @cached_property
    def views(self) -> Views:  # type: ignore[override]
        return views_of(self.fmt)

    def targets(self, rank: RankLayout, spec: ModelSpec) -> dict[str, Target] | None:
        return quantized(rank, spec, self.fmt)

    def __str__(self) -> str:
        return f", serving {self.fmt.name}"


def served(model: torch.nn.Module) -> Served:
    """What ``model`` serves: its FP8 format (``served_format``) when SGLang quantizes it."""
    quant_config = model.quant_config  # every SGLang model class keeps its own (None: unquantized)
    return Served() if quant_config is None else ServedFp8(served_format(model, quant_config))


def served_format(model: torch.nn.Module, quant_config: object) -> Fp8Format:
    """The FP8 format ``model``'s parameters hold (``quant_config``: SGLang's); ValueError
    saying why shardsync cannot write them (another quantization, another block, state SGLang
    derives from them after a load)."""
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    if not isinstance(quant_config, Fp8Config):
        name = type(quant_config).__name__
        raise ValueError(f"SGLang runs {name} quantization; shardsync syncs unquantized models and 128 x 128 "
                         "block FP8 ones")
    if quant_config.use_mxfp8 or quant_config.weight_block_size != [128, 128]:
        raise ValueError(f"SGLang serves FP8 with weight blocks {quant_config.weight_block_size} (an online "
                         "--quantization fp8 of a bf16 checkpoint when None: it quantizes at load); shardsync writes "
                         "128 x 128 block-scaled FP8: serve a block FP8 checkpoint (quantization_config "
                         "weight_block_size [128, 128]) or bf16")
    if deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0:
        raise ValueError("SGLang re-quantizes FP8 weights to UE8M0 scales for DeepGEMM on this GPU after a load "
                         "(requant_block_scale_ue8m0_for_deepgemm): not supported yet; serve with "
                         "SGLANG_ENABLE_JIT_DEEPGEMM=0 or bf16")
    cached = next((n for n, _ in model.named_buffers() if n.endswith("._block_fp8_bf16_weight")), None)
    if cached is not None:
        raise ValueError(f"SGLang keeps a bf16 expansion of its FP8 weights ({cached}) that an in-place write "
                         "would leave stale; serve with SGLANG_OPT_HOPPER_BLOCK_FP8_BF16=0")
    return fp8_format("fp8-block128x128-ue8m0" if quant_config.scale_fmt == "ue8m0" else "fp8")
