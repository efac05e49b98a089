"""Which engine tensors an FP8 engine quantizes (``quant/targets.py``): SGLang's names and
scale shapes, and the refusals (pieces that are not whole blocks, families not in the table).
The same names and shapes against SGLang's own FP8 classes: ``tests/sglang/test_sglang_fp8.py``."""

from __future__ import annotations

import pytest

from shardsync.family.table import Supports
from shardsync.layout import EngineParallel, engine_layout
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format, quantized
from shardsync.quant.support import receiver_quantizes, refusal

FP8 = fp8_format("fp8")


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (4, 1), (2, 2), (4, 4)])
def test_moe_targets_and_scale_shapes(tp: int, ep: int) -> None:
    spec = PRESETS["tiny-qwen3-moe-fp8"]
    rank = engine_layout(spec, EngineParallel(tp=tp, ep=ep, dtype="bfloat16")).ranks[0]
    targets = quantized(rank, spec, FP8)
    layer = {n.removeprefix("model.layers.1."): t for n, t in targets.items() if n.startswith("model.layers.1.")}
    qkv = (512 + 2 * 512) // tp
    assert layer["self_attn.qkv_proj.weight"].scale_shape == (qkv // 128, 2)
    assert layer["self_attn.o_proj.weight"].scale_shape == (2, 512 // tp // 128)
    experts, moe_tp = 8 // ep, tp // ep
    assert layer["mlp.experts.w13_weight"].shape == (experts, 1024 // moe_tp, 256)
    assert layer["mlp.experts.w13_weight"].scale_shape == (experts, 1024 // moe_tp // 128, 2)
    assert layer["mlp.experts.w2_weight"].scale == "model.layers.1.mlp.experts.w2_weight_scale_inv"
    # the router, norms, embedding and (tied) head stay in the model dtype
    assert not any(n.endswith(("gate.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight")) for n in targets)
    assert len(targets) == 4 * 2 + 4 * 2  # attention and experts, 4 layers


def test_per_channel_scales_are_one_per_row() -> None:
    spec = PRESETS["tiny-qwen3-fp8"]
    rank = engine_layout(spec, EngineParallel(tp=2, dtype="bfloat16")).ranks[1]
    t = quantized(rank, spec, fp8_format("fp8-channel"))["model.layers.0.mlp.down_proj.weight"]
    assert t.scale == "model.layers.0.mlp.down_proj.weight_scale" and t.scale_shape == (256, 1)


def test_a_shard_cutting_blocks_is_refused_with_the_tensor_and_rows() -> None:
    spec = PRESETS["tiny-qwen3"]  # 2 KV heads x 64: 64 rows of k per rank at TP 2
    rank = engine_layout(spec, EngineParallel(tp=2)).ranks[0]
    with pytest.raises(ValueError,
                       match=r"qkv_proj.weight \[384, 256\] holds .*k_proj.weight rows 0:64, .* at rows 256"):
        quantized(rank, spec, FP8)


@pytest.mark.parametrize(("model", "fp8", "kept"), [
    ("tiny-deepseek-v32-fp8", ("indexer.wq_b.weight", "indexer.wk.weight"), ("indexer.weights_proj.weight",)),
    ("tiny-qwen3-next-fp8", ("linear_attn.in_proj_qkvz.weight", "linear_attn.out_proj.weight", "qkv_proj.weight"),
     ("linear_attn.in_proj_ba.weight", "linear_attn.conv1d.weight", "mlp.shared_expert_gate.weight")),
])
def test_sparse_and_linear_attention_quantize_what_their_checkpoints_do(model: str, fp8: tuple[str, ...],
                                                                        kept: tuple[str, ...]) -> None:
    spec = PRESETS[model]
    rank = engine_layout(spec, EngineParallel(tp=2, dtype="bfloat16")).ranks[0]
    names = set(quantized(rank, spec, FP8))
    assert all(any(n.endswith(f) for n in names) for f in fp8), sorted(names)
    held = {t.name for t in rank.tensors}
    assert all(any(n.endswith(k) for n in held) and not any(n.endswith(k) for n in names) for k in kept)


def test_every_family_attention_declares_fp8_and_names_its_quantized_rows() -> None:
    """A new attention block must say which of its linears an FP8 checkpoint quantizes (its rows'
    ``fp8``) and declare FP8 (``Block.supports``) before FP8 engines of it are planned:
    ``check_family`` refuses it until then."""
    blocks = {spec.family_table.blocks(spec, layer)[0] for spec in PRESETS.values()
              for layer in range(spec.num_layers)}
    assert all(Supports.FP8 in b.supports for b in blocks), [b.kind for b in blocks if Supports.FP8 not in b.supports]
    assert all(any(r.fp8 for r in b.engine) for b in blocks if Supports.FP8 in b.supports)


def test_which_engines_take_shards_and_which_are_refused() -> None:
    assert receiver_quantizes("reference", None) and receiver_quantizes("reference", "fp8")
    assert receiver_quantizes("sglang", "fp8") and not receiver_quantizes("vllm", "fp8")
    assert not receiver_quantizes("reference", "fp8-per-tensor")
    assert refusal(None) is None and refusal("fp8") is None
    reason = refusal("compressed-tensors")
    assert reason is not None and "INT4" in reason and "bf16 or FP8" in reason
    assert refusal("NVFP4") is not None and refusal("mxfp4") is not None


_MLP = {"mlp.gate_up_proj.weight", "mlp.down_proj.weight"}
_EXPERTS = {"mlp.experts.w13_weight", "mlp.experts.w2_weight"}
_MLA = {"self_attn.kv_b_proj.weight", "self_attn.o_proj.weight"}
FP8_ROWS = {  # per model, every layer's tensors an FP8 engine holds in e4m3 (the rows' ``fp8``)
    "tiny-qwen3": {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", *_MLP},
    "tiny-qwen3-moe-fp8": {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", *_EXPERTS},
    "tiny-deepseek-v3": {"self_attn.fused_qkv_a_proj_with_mqa.weight", "self_attn.q_b_proj.weight", *_MLA, *_MLP,
                         *_EXPERTS, "mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight"},
    "tiny-deepseek-v3-q-proj": {"self_attn.q_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", *_MLA, *_MLP,
                                *_EXPERTS, "mlp.shared_experts.gate_up_proj.weight",
                                "mlp.shared_experts.down_proj.weight"},
}


@pytest.mark.parametrize("model", FP8_ROWS)
def test_the_family_rows_say_which_tensors_are_fp8(model: str) -> None:
    """Linears and experts only: never a norm, a router, its bias, the embedding or the LM head."""
    spec = PRESETS[model]
    rank = engine_layout(spec, EngineParallel(tp=1)).ranks[0]
    held = {t.name.split(".", 3)[-1] for t in rank.tensors if t.fp8}
    assert held == FP8_ROWS[model]
    assert not any(t.fp8 for t in rank.tensors if not t.name.startswith("model.layers."))
