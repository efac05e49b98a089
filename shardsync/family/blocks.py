"""The blocks decoder families share: grouped-query attention, multi-head latent attention,
the gated MLP (two checkpoint tensors or one fused), and the mixture-of-experts MLP (router,
optional score-correction bias, routed experts, optional shared experts).  Rows are in
parameter order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardsync.family.kinds import Concat, ExpertMlps, ExpertStacks, Fused, Part, QkvGroups, QkvHeads, Split, Whole
from shardsync.family.section import Latent
from shardsync.family.table import Attention, Block, MtpHead, PerExpert, Row, SharedExpert, Supports, T

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


def qkv_bias(spec: ModelSpec) -> bool:
    return spec.qkv_bias


def qk_norm(spec: ModelSpec) -> bool:
    return spec.qk_norm


def post_norms(spec: ModelSpec) -> bool:
    return spec.post_norms


def expert_bias(spec: ModelSpec) -> bool:
    """A per-expert score-correction bias (sigmoid routers: GLM4-MoE, DeepSeek-V3)."""
    return spec.router == "sigmoid"


def shared_experts(spec: ModelSpec) -> bool:
    return spec.shared_expert_intermediate_size > 0


GQA = Block(
    logical=(
        T("input_layernorm.weight", "H"),
        T("self_attn.q_proj.weight", "q", "H"),
        T("self_attn.k_proj.weight", "kv", "H"),
        T("self_attn.v_proj.weight", "kv", "H"),
        T("self_attn.q_proj.bias", "q", when=qkv_bias),
        T("self_attn.k_proj.bias", "kv", when=qkv_bias),
        T("self_attn.v_proj.bias", "kv", when=qkv_bias),
        T("self_attn.q_norm.weight", "d", when=qk_norm),
        T("self_attn.k_norm.weight", "d", when=qk_norm),
        T("self_attn.o_proj.weight", "H", "q"),
        T("post_self_attn_layernorm.weight", "H", when=post_norms),
    ),
    kind=Attention.GQA,
    supports=frozenset({Supports.FP8, Supports.ADAPTER}),
    megatron=(
        Row("{attn_norm}", Whole("input_layernorm.weight")),
        Row("self_attention.linear_qkv.weight", QkvGroups("weight")),
        Row("self_attention.linear_qkv.bias", QkvGroups("bias"), when=qkv_bias),
        Row("self_attention.q_layernorm.weight", Whole("self_attn.q_norm.weight"), when=qk_norm),
        Row("self_attention.k_layernorm.weight", Whole("self_attn.k_norm.weight"), when=qk_norm),
        Row("self_attention.linear_proj.weight", Split("self_attn.o_proj.weight", dim=1)),
        Row("post_self_attn_layernorm.weight", Whole(), when=post_norms),
    ),
    engine=(
        Row("input_layernorm.weight", Whole()),
        Row("self_attn.qkv_proj.weight", QkvHeads("weight"), fp8=True),
        Row("self_attn.qkv_proj.bias", QkvHeads("bias"), when=qkv_bias),
        Row("self_attn.q_norm.weight", Whole(), when=qk_norm),
        Row("self_attn.k_norm.weight", Whole(), when=qk_norm),
        Row("self_attn.o_proj.weight", Split(dim=1), fp8=True),
        Row("post_self_attn_layernorm.weight", Whole(), when=post_norms),
    ),
)


def q_lora(spec: ModelSpec) -> bool:
    """MLA's query goes through a low-rank down projection (DeepSeek-V3; not V2-Lite)."""
    return spec.section(Latent).q_lora_rank is not None


def no_q_lora(spec: ModelSpec) -> bool:
    return spec.section(Latent).q_lora_rank is None


_A = "self_attn."
_QKV_A = (_A + "q_a_proj.weight", _A + "kv_a_proj_with_mqa.weight")
# Multi-head latent attention.  Every head-major tensor (q_b / q_proj, kv_b: per head
# [nope; rope] / [k_nope; v]) splits over TP by heads; the down projections and their norms
# are whole on every rank, except in megatron-core's local spec, whose down projections are
# column-parallel (a plain row split, not head aligned).  Megatron's TE spec fuses the q/kv
# norms into the up projections; row orders are the HF ones on every side.
MLA = Block(
    logical=(
        T("input_layernorm.weight", "H"),
        T(_A + "q_a_proj.weight", "ql", "H", when=q_lora),
        T(_A + "q_a_layernorm.weight", "ql", when=q_lora),
        T(_A + "q_b_proj.weight", "qh", "ql", when=q_lora),
        T(_A + "q_proj.weight", "qh", "H", when=no_q_lora),
        T(_A + "kv_a_proj_with_mqa.weight", "kva", "H"),
        T(_A + "kv_a_layernorm.weight", "kl"),
        T(_A + "kv_b_proj.weight", "kvb", "kl"),
        T(_A + "o_proj.weight", "H", "hv"),
    ),
    kind=Attention.MLA,
    supports=frozenset({Supports.FP8}),
    rotary="rope",
    megatron=(
        Row("input_layernorm.weight", Whole()),
        Row("self_attention.linear_q_down_proj.weight", Whole(_A + "q_a_proj.weight"), when=q_lora, variant="fused"),
        Row("self_attention.linear_q_down_proj.weight", Split(_A + "q_a_proj.weight"), when=q_lora,
            variant="separate"),
        Row("self_attention.linear_q_up_proj.layer_norm_weight", Whole(_A + "q_a_layernorm.weight"), when=q_lora,
            variant="fused"),
        Row("self_attention.linear_q_up_proj.weight", Split(_A + "q_b_proj.weight"), when=q_lora),
        Row("self_attention.linear_q_proj.weight", Split(_A + "q_proj.weight"), when=no_q_lora),
        Row("self_attention.linear_kv_down_proj.weight", Whole(_A + "kv_a_proj_with_mqa.weight"), variant="fused"),
        Row("self_attention.linear_kv_down_proj.weight", Split(_A + "kv_a_proj_with_mqa.weight"), variant="separate"),
        Row("self_attention.linear_kv_up_proj.layer_norm_weight", Whole(_A + "kv_a_layernorm.weight"),
            variant="fused"),
        Row("self_attention.linear_kv_up_proj.weight", Split(_A + "kv_b_proj.weight")),
        Row("self_attention.linear_proj.weight", Split(_A + "o_proj.weight", dim=1)),
        Row("self_attention.q_layernorm.weight", Whole(_A + "q_a_layernorm.weight"), when=q_lora, variant="separate"),
        Row("self_attention.kv_layernorm.weight", Whole(_A + "kv_a_layernorm.weight"), variant="separate"),
    ),
    engine=(
        Row("input_layernorm.weight", Whole()),
        Row(_A + "fused_qkv_a_proj_with_mqa.weight", Concat(_QKV_A), when=q_lora, unless="vllm", fp8=True),
        Row(_A + "fused_qkv_a_proj.weight", Concat(_QKV_A), when=q_lora, variant="vllm", fp8=True),
        Row(_A + "q_a_layernorm.weight", Whole(), when=q_lora),
        Row(_A + "q_b_proj.weight", Split(), when=q_lora, fp8=True),
        Row(_A + "q_proj.weight", Split(), when=no_q_lora, fp8=True),
        Row(_A + "kv_a_proj_with_mqa.weight", Whole(), when=no_q_lora, fp8=True),
        Row(_A + "kv_a_layernorm.weight", Whole()),
        Row(_A + "kv_b_proj.weight", Split(), fp8=True),
        Row(_A + "o_proj.weight", Split(dim=1), fp8=True),
    ),
)



_I = _A + "indexer."
_INDEX_KEY = (_I + "wk.weight", _I + "weights_proj.weight")


def with_indexer(mla: Block) -> Block:
    """DeepSeek sparse attention: MLA plus its lightning indexer (``wq_b`` reads the query's
    latent, ``wk`` and ``weights_proj`` the layer input, ``k_norm`` a LayerNorm with a bias).
    Replicated on every TP rank of every side.  An FP8 engine quantizes ``wq_b`` and ``wk`` (SGLang's
    ``Fp8Config``); ``weights_proj`` and the fused key stay bfloat16.  SGLang holds ``weights_proj`` in bfloat16 and
    ``k_norm`` in float32 whatever the model's dtype, and on CUDA fuses ``wk`` and
    ``weights_proj`` into one bfloat16 ``wk_weights_proj`` when the indexer's rotary is
    interleaved (GLM-5; variant ``indexer_fused``); vLLM always fuses them, in the model's
    dtype.  Megatron-core holds it under ``core_attention.indexer`` (``linear_`` names),
    replicated, in the model dtype, row for row the HF tensors from 0.19 on (0.16-0.18 put
    each head's rotary channels last: docs/models.md)."""
    m = "self_attention.core_attention.indexer."
    return Block(
        logical=(*mla.logical,
                 T(_I + "wq_b.weight", "iq", "ql"), T(_I + "wk.weight", "id", "H"),
                 T(_I + "k_norm.weight", "id"), T(_I + "k_norm.bias", "id"),
                 T(_I + "weights_proj.weight", "ih", "H")),
        kind=Attention.DSA,
        supports=mla.supports,
        rotary=mla.rotary,
        # megatron-core builds core_attention (the indexer) before the projections: first after the input norm
        megatron=(mla.megatron[0],
                  Row(m + "linear_wq_b.weight", Whole(_I + "wq_b.weight")),
                  Row(m + "linear_wk.weight", Whole(_I + "wk.weight")),
                  Row(m + "k_norm.weight", Whole(_I + "k_norm.weight")),
                  Row(m + "k_norm.bias", Whole(_I + "k_norm.bias")),
                  Row(m + "linear_weights_proj.weight", Whole(_I + "weights_proj.weight")),
                  *mla.megatron[1:]),
        engine=(*mla.engine,
                Row(_I + "wq_b.weight", Whole(), fp8=True),
                Row(_I + "wk.weight", Whole(), unless=("indexer_fused", "vllm"), fp8=True),
                Row(_I + "weights_proj.weight", Whole(), dtype="bfloat16", unless=("indexer_fused", "vllm")),
                Row(_I + "wk_weights_proj.weight", Concat(_INDEX_KEY), dtype="bfloat16", variant="indexer_fused",
                    unless="vllm"),
                Row(_I + "wk_weights_proj.weight", Concat(_INDEX_KEY), variant="vllm"),
                Row(_I + "k_norm.weight", Whole(), dtype="float32"),
                Row(_I + "k_norm.bias", Whole(), dtype="float32")),
    )


DSA = with_indexer(MLA)

def gated_mlp(*, fused_checkpoint: bool = False) -> Block:
    """The dense MLP; ``fused_checkpoint``: gate and up are one HF tensor (GLM4)."""
    if fused_checkpoint:
        gate, up = Part("mlp.gate_up_proj.weight", 0, 2), Part("mlp.gate_up_proj.weight", 1, 2)
        proj: tuple[T, ...] = (T("mlp.gate_up_proj.weight", "2F", "H"),)
    else:
        gate, up = Part("mlp.gate_proj.weight"), Part("mlp.up_proj.weight")
        proj = (T("mlp.gate_proj.weight", "F", "H"), T("mlp.up_proj.weight", "F", "H"))
    return Block(
        logical=(T("post_attention_layernorm.weight", "H"), *proj, T("mlp.down_proj.weight", "H", "F"),
                 T("post_mlp_layernorm.weight", "H", when=post_norms)),
        megatron=(
            Row("{mlp_norm}", Whole("post_attention_layernorm.weight")),
            Row("mlp.linear_fc1.weight", Fused((gate, up))),
            Row("mlp.linear_fc2.weight", Split("mlp.down_proj.weight", dim=1)),
            Row("post_mlp_layernorm.weight", Whole(), when=post_norms),
        ),
        engine=(
            Row("post_attention_layernorm.weight", Whole()),
            Row("mlp.gate_up_proj.weight", Fused((gate, up)), fp8=True),
            Row("mlp.down_proj.weight", Split(dim=1), fp8=True),
            Row("post_mlp_layernorm.weight", Whole(), when=post_norms),
        ),
    )


_EXPERT = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
_SHARED = "mlp.shared_experts."  # Megatron's, whatever the checkpoint calls it


def moe(*, router_dtype: str | None = None, shared: str = _SHARED, shared_gate: bool = False) -> Block:
    """The mixture-of-experts MLP.  Engines hold a sigmoid router's score-correction bias in
    float32 (SGLang and vLLM alike) and, for some families, the router weight too
    (``router_dtype``); megatron-core keeps the bias (``expert_bias``, a buffer) in float32 and
    the router weight in the model dtype.  Held float32 on both sides, the bias moves as its
    own bits under a bfloat16 sync (``layout/raw.py``).  ``shared``: the checkpoint's prefix of
    the shared expert (Qwen3-Next: ``mlp.shared_expert.``); ``shared_gate``: a sigmoid gate
    ``mlp.shared_expert_gate [1, H]`` scales it (megatron-core's ``shared_experts.gate_weight``)."""
    gate_up = Fused((Part(shared + "gate_proj.weight"), Part(shared + "up_proj.weight")))
    mlp = (shared + "gate_proj.weight", shared + "up_proj.weight", shared + "down_proj.weight")
    return Block(
        logical=(
            T("post_attention_layernorm.weight", "H"),
            T("mlp.gate.weight", "E", "H"),
            T("mlp.gate.e_score_correction_bias", "E", when=expert_bias),
            PerExpert((T(_EXPERT[0], "Fe", "H"), T(_EXPERT[1], "Fe", "H"), T(_EXPERT[2], "H", "Fe"))),
            T(mlp[0], "Fs", "H", when=shared_experts),
            T(mlp[1], "Fs", "H", when=shared_experts),
            T(mlp[2], "H", "Fs", when=shared_experts),
            *((T("mlp.shared_expert_gate.weight", "one", "H", when=shared_experts),) if shared_gate else ()),
        ),
        megatron=(
            # the norm cannot fuse into the router: always its own module
            Row("pre_mlp_layernorm.weight", Whole("post_attention_layernorm.weight")),
            Row("mlp.router.weight", Whole("mlp.gate.weight")),
            # moe_router_enable_expert_bias: a buffer, updated by load balancing
            Row("mlp.router.expert_bias", Whole("mlp.gate.e_score_correction_bias"), when=expert_bias,
                dtype="float32"),
            Row("mlp.experts", ExpertMlps(*_EXPERT)),
            # SharedExpertMLP's own parameter: before its linears in named_parameters()
            *((Row(_SHARED + "gate_weight", Whole("mlp.shared_expert_gate.weight"), when=shared_experts),)
              if shared_gate else ()),
            Row(_SHARED + "linear_fc1.weight", gate_up, when=shared_experts),
            Row(_SHARED + "linear_fc2.weight", Split(mlp[2], dim=1), when=shared_experts),
        ),
        engine=(
            Row("post_attention_layernorm.weight", Whole()),
            Row("mlp.gate.weight", Whole(), dtype=router_dtype),
            Row("mlp.gate.e_score_correction_bias", Whole(), when=expert_bias, dtype="float32"),
            Row("mlp.experts", ExpertStacks(*_EXPERT, shared=mlp), unless="vllm", fp8=True),
            Row("mlp.experts.routed_experts", ExpertStacks(*_EXPERT, shared=mlp), variant="vllm", fp8=True),
            Row(shared + "gate_up_proj.weight", gate_up, when=shared_experts, unless="shared_fused", fp8=True),
            Row(shared + "down_proj.weight", Split(dim=1), when=shared_experts, unless="shared_fused", fp8=True),
            *((Row("mlp.shared_expert_gate.weight", Whole(), when=shared_experts),) if shared_gate else ()),
        ),
        shared=SharedExpert(shared.removeprefix("mlp.").rstrip("."), gated=shared_gate),
    )


MOE = moe()


# A DeepSeek-style MTP layer's head: input = eh_proj(cat(enorm(embedding), hnorm(hidden))), the
# decoder layer, then shared_head.norm before the shared output layer.  Megatron: ``mtp.layers.{k}.``
# with the layer under ``transformer_layer.`` and the output norm ``final_layernorm``; the
# checkpoint's ``embed_tokens`` / ``shared_head.head`` copies are the main model's (shared, not
# logical tensors of their own).
MTP = MtpHead(
    before=Block(
        logical=(T("enorm.weight", "H"), T("hnorm.weight", "H"), T("eh_proj.weight", "H", "2H")),
        megatron=(Row("enorm.weight", Whole()), Row("hnorm.weight", Whole()), Row("eh_proj.weight", Split())),
        engine=(),
    ),
    after=Block(
        logical=(T("shared_head.norm.weight", "H"),),
        megatron=(Row("final_layernorm.weight", Whole("shared_head.norm.weight")),),
        engine=(),
    ),
)
