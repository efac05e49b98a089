"""The blocks of the gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): the linear-attention layer and the
full-attention layer with an output gate.  Sources: docs/notes/qwen3_next_sources.md (transformers,
megatron-core, slime) and qwen3_next_engines.md (SGLang, vLLM).

The checkpoint's ``in_proj_qkvz`` / ``in_proj_ba`` interleave per key-head group (group j: q_j,
k_j, then v and z of its value heads; b then a); both engines split them over TP by whole groups
and keep that order (a contiguous row block: ``Split``).  The conv channels are ``[q | k | v]``,
not interleaved: a rank holds its heads' channels of each (``Fused`` of ``Rows``).  ``A_log`` is
float32 on the engines.  Megatron: slime's layer (an HF-style module replicated on every TP rank
under ``self_attention.``); megatron-core's own ``GatedDeltaNet`` (per rank ``[q|k|v|z|b|a]``,
``out_norm`` stored minus one) is not held yet.  Full attention: ``q_proj`` holds each head's query
then its gate; SGLang names the layer's tensors without ``self_attn.``, vLLM with it.  FP8
checkpoints quantize ``in_proj_qkvz``, ``out_proj`` and the full attention's projections, not
``in_proj_ba`` (its rows are no whole block: vLLM #25079) nor the conv."""

from __future__ import annotations

from shardsync.family.kinds import Fused, Part, QkvGroups, QkvHeads, Rows, Split, Whole
from shardsync.family.table import Attention, Block, MtpHead, Row, Supports, T

_L = "linear_attn."
_CONV = _L + "conv1d.weight"
_OWN = ("dt_bias", "A_log")  # the layer module's own parameters: first in named_parameters()
_REST = ("conv1d.weight", "norm.weight", "out_proj.weight")


def gated_deltanet(*, interleaved: bool) -> Block:
    """The linear-attention layer.  ``interleaved`` (Qwen3-Next): the checkpoint fuses q, k, v, z in
    ``in_proj_qkvz`` and b, a in ``in_proj_ba``, per key-head group; the engines' rank holds whole
    groups in that order.  Otherwise (Qwen3.5) the checkpoint holds ``in_proj_qkv`` ([q | k | v]),
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` and the engines stack a rank's heads of each:
    ``[q | k | v | z]`` and ``[b | a]``."""
    qkv = _L + "in_proj_qkv.weight"
    own: tuple[T, ...]
    qkvz: Split | Fused
    ba: Split | Fused
    if interleaved:
        own = (T(_L + "in_proj_qkvz.weight", "lqkvz", "H"), T(_L + "in_proj_ba.weight", "lba", "H"))
        qkvz, ba = Split(), Split()
    else:
        own = (T(qkv, "lconv", "H"), T(_L + "in_proj_z.weight", "lvd", "H"),
               T(_L + "in_proj_b.weight", "lnv", "H"), T(_L + "in_proj_a.weight", "lnv", "H"))
        qkvz = Fused((Rows(qkv, "lq"), Rows(qkv, "lq", start="lq"), Rows(qkv, "lvd", start="2lq"),
                      Part(_L + "in_proj_z.weight")))
        ba = Fused((Part(_L + "in_proj_b.weight"), Part(_L + "in_proj_a.weight")))
    projections = tuple(t.name.removeprefix(_L) for t in own)
    return Block(
        logical=(
            T("input_layernorm.weight", "H"),
            *own,
            T(_CONV, "lconv", "one", "lkern"),
            T(_L + "dt_bias", "lnv"),
            T(_L + "A_log", "lnv"),
            T(_L + "norm.weight", "ldv"),
            T(_L + "out_proj.weight", "H", "lvd"),
        ),
        kind=Attention.GDN if interleaved else Attention.GDN_STACKED,
        supports=frozenset({Supports.FP8}),
        megatron=(
            Row("self_attention.input_layernorm.weight", Whole("input_layernorm.weight")),
            *(Row("self_attention." + _L + t, Whole(_L + t)) for t in (*_OWN, *projections, *_REST)),
        ),
        engine=(
            Row("input_layernorm.weight", Whole()),
            Row(_L + "dt_bias", Split()),
            Row(_L + "A_log", Split(), dtype="float32"),
            Row(_L + "in_proj_qkvz.weight", qkvz, fp8=True),
            Row(_L + "in_proj_ba.weight", ba),
            Row(_CONV, Fused((Rows(_CONV, "lq"), Rows(_CONV, "lq", start="lq"), Rows(_CONV, "lvd", start="2lq")))),
            Row(_L + "norm.weight", Whole()),
            Row(_L + "out_proj.weight", Split(dim=1), fp8=True),
        ),
    )


GATED_DELTANET = gated_deltanet(interleaved=True)
GATED_DELTANET_SEPARATE = gated_deltanet(interleaved=False)

_A = "self_attn."


def _engine(name: str, kind: Whole | Split | QkvHeads, *, fp8: bool = False) -> tuple[Row, Row]:
    """SGLang's row (no ``self_attn.`` level) and vLLM's (with it) of one attention tensor."""
    return Row(name, kind, unless="vllm", fp8=fp8), Row(_A + name, kind, variant="vllm", fp8=fp8)


GATED_GQA = Block(
    logical=(
        T("input_layernorm.weight", "H"),
        T(_A + "q_proj.weight", "q2", "H"),
        T(_A + "k_proj.weight", "kv", "H"),
        T(_A + "v_proj.weight", "kv", "H"),
        T(_A + "q_norm.weight", "d"),
        T(_A + "k_norm.weight", "d"),
        T(_A + "o_proj.weight", "H", "q"),
    ),
    kind=Attention.GQA_GATED,
    supports=frozenset({Supports.FP8}),
    megatron=(
        Row("{attn_norm}", Whole("input_layernorm.weight")),
        Row("self_attention.linear_qkv.weight", QkvGroups("weight", gate=True)),
        Row("self_attention.q_layernorm.weight", Whole(_A + "q_norm.weight")),
        Row("self_attention.k_layernorm.weight", Whole(_A + "k_norm.weight")),
        Row("self_attention.linear_proj.weight", Split(_A + "o_proj.weight", dim=1)),
    ),
    engine=(
        Row("input_layernorm.weight", Whole()),
        *_engine("qkv_proj.weight", QkvHeads("weight", gate=True), fp8=True),
        *_engine("q_norm.weight", Whole(_A + "q_norm.weight")),
        *_engine("k_norm.weight", Whole(_A + "k_norm.weight")),
        *_engine("o_proj.weight", Split(_A + "o_proj.weight", dim=1), fp8=True),
    ),
)


# The checkpoint's MTP layer (Qwen3-Next, Qwen3.5): ``mtp.fc`` projects ``[pre_fc_norm_embedding(embedding)
# | pre_fc_norm_hidden(hidden)]`` (megatron-core 0.16.1's eh_proj input order: copied as is), then a
# full-attention layer ``mtp.layers.{k}.`` and ``mtp.norm`` before the main output layer.  Megatron:
# DeepSeek's names (``enorm``, ``hnorm``, ``eh_proj``, ``final_layernorm``).
QWEN_MTP = MtpHead(
    before=Block(
        logical=(T("pre_fc_norm_embedding.weight", "H"), T("pre_fc_norm_hidden.weight", "H"),
                 T("fc.weight", "H", "2H")),
        megatron=(Row("enorm.weight", Whole("pre_fc_norm_embedding.weight")),
                  Row("hnorm.weight", Whole("pre_fc_norm_hidden.weight")),
                  Row("eh_proj.weight", Split("fc.weight"))),
        engine=(),
    ),
    after=Block(logical=(T("norm.weight", "H"),), megatron=(Row("final_layernorm.weight", Whole("norm.weight")),),
                engine=()),
    head="mtp.",
    layer="mtp.layers.{k}.",
)
