"""shardsync's engine layout is SGLang's: for tiny Qwen3, Qwen2 (bias, tied embeddings),
Llama, Qwen3-MoE (triton backend), DeepSeek-V3 (latent attention, shared experts), DeepSeek-V3.2
and GLM-5 (sparse attention's indexer: bf16 ``weights_proj``, fp32 ``k_norm``) at TP 1,
2 and 4, at PP 2 (TP 1 and 2) and, for the MoE models, at EP 2 and 4, every rank's
``named_parameters()`` has shardsync's names, shapes and dtype, and SGLang's own
``load_weights`` of the full HF tensors equals shardsync's ``load_rank`` of them bit for bit
(padded vocab rows zero).  SGLang's shared-expert fusion (forced on: CPU would not choose it)
is the ``shared_fused`` layout variant, its fused indexer key (forced likewise) ``indexer_fused``,
and SGLang's host finds them from the parameters.  At
TP 1 SGLang's forward on those parameters matches ``transformers``."""

from __future__ import annotations

import pytest
import torch

from shardsync.engines.sglang.host import SglangHost
from shardsync.family.section import Latent
from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.receiver.match import live_difference
from tests.sglang import _models

SPECS, MODELS = _models.SPECS, tuple(_models.SPECS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("model", MODELS)
def test_sglang_parameters_are_shardsync_engine_layout(model, dtype) -> None:
    # the checkpoint in the served dtype, as deployed (SGLang builds Qwen3-Next's gated norm in the checkpoint's)
    spec, dt = SPECS[model].replace(dtype=dtype), DTYPES[dtype]
    seeded = random_source(spec, seed=7)

    def source(name: str) -> torch.Tensor:  # the trainer's tensors, in the model dtype
        return seeded(name).to(dt)

    full = {n: source(n) for n in logical_tensors(spec)}
    worlds = ((1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 2, 1), (2, 2, 1)) + (((2, 1, 2), (4, 1, 4)) if spec.is_moe else ())
    for tp, pp, ep in worlds:
        if pp > 1 and model in _models.NO_PP:
            continue
        lay = engine_layout(spec, EngineParallel(tp=tp, pp=pp, ep=ep, dtype=dtype))
        for i in range(tp * pp):  # stage-major
            m = _models.build(_models.hf_config(spec), i % tp, tp, dt, pp_rank=i // tp, pp_size=pp, ep_size=ep)
            _models.sglang_load(m, full)
            assert live_difference(lay.ranks[i], m, "SGLang") is None, (tp, pp, ep, i)
            mine = load_rank(lay, i, source)
            bad = [n for n, p in m.named_parameters() if not torch.equal(p.data.flatten(), mine[n].flatten())]
            assert bad == [], (tp, pp, ep, i, bad[:4])
            if spec.find(Latent) is not None:  # SGLang's derived per-rank heads of kv_b_proj exist and have their shape
                heads = spec.num_heads // tp
                kc = _models.derived(m)[f"model.layers.{i // tp * spec.num_layers // pp}.self_attn.w_kc"]
                lat = spec.section(Latent)
                assert tuple(kc.shape) == (heads, lat.qk_nope_head_dim, lat.kv_lora_rank), (tp, kc.shape)


@pytest.mark.parametrize("model", ["tiny-deepseek-v3", "tiny-qwen3-next"])
@pytest.mark.parametrize("tp", [1, 2])
def test_fused_shared_expert_is_the_shared_fused_variant(tp, model) -> None:
    spec = SPECS[model]
    source = random_source(spec, seed=5)
    full = {n: source(n) for n in logical_tensors(spec)}
    fused = engine_layout(spec, EngineParallel(tp=tp, variants=frozenset({"shared_fused"})))
    apart = engine_layout(spec, EngineParallel(tp=tp))
    for r in range(tp):
        m = _models.sglang_load(_models.build(_models.hf_config(spec), r, tp, shared_fused=True), full)
        w13 = dict(m.named_parameters())["model.layers.1.mlp.experts.w13_weight"]
        assert w13.shape[0] == spec.num_experts + 1  # the shared expert is expert E
        assert live_difference(apart.ranks[r], m, "SGLang") is not None
        assert live_difference(fused.ranks[r], m, "SGLang") is None
        mine = load_rank(fused, r, source)
        assert [n for n, p in m.named_parameters() if not torch.equal(p.data.flatten(), mine[n].flatten())] == []
        host = SglangHost(m)  # what SGLang's rank finds its parameters are, before any trainer plans
        assert host.problem is None and host.variants == {"shared_fused"}
        assert host.rank is not None and host.rank.layout_reason is None


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_indexer_key_is_the_indexer_fused_variant(tp) -> None:
    """GLM-5 on CUDA: SGLang holds the indexer's ``wk`` and ``weights_proj`` as one bfloat16
    ``wk_weights_proj`` (``wk`` rounded too, in a float32 model): the ``indexer_fused`` variant,
    bit for bit its own load, found from the parameters by SGLang's host."""
    spec = SPECS["tiny-glm5"]
    source = random_source(spec, seed=5)
    full = {n: source(n) for n in logical_tensors(spec)}
    fused = engine_layout(spec, EngineParallel(tp=tp, variants=frozenset({"indexer_fused"})))
    for r in range(tp):
        m = _models.sglang_load(_models.build(_models.hf_config(spec), r, tp, indexer_fused=True), full)
        key = dict(m.named_parameters())["model.layers.1.self_attn.indexer.wk_weights_proj.weight"]
        assert key.dtype == torch.bfloat16
        assert live_difference(engine_layout(spec, EngineParallel(tp=tp)).ranks[r], m, "SGLang") is not None
        assert live_difference(fused.ranks[r], m, "SGLang") is None
        mine = load_rank(fused, r, source)
        assert [n for n, p in m.named_parameters() if not torch.equal(p.data.flatten(), mine[n].flatten())] == []
        host = SglangHost(m)
        assert host.problem is None and host.variants == {"indexer_fused"}


def test_tied_lm_head_is_the_embedding() -> None:
    spec = PRESETS["tiny-qwen2"]
    assert spec.tie_word_embeddings
    m = _models.build(_models.hf_config(spec), 0, 2)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(m.named_parameters())


# latent attention needs SGLang's MLA KV pool and backend, the gated DeltaNet its mamba state pools: not built
# here, so only grouped-query attention's forward is compared
@pytest.mark.parametrize("model", [m for m in MODELS if SPECS[m].family_table.attention.kind == "gqa"])
def test_sglang_forward_matches_transformers_at_tp1(model) -> None:
    spec = SPECS[model]
    source = random_source(spec, seed=11)
    full = {n: source(n) for n in logical_tensors(spec)}
    m = _models.sglang_load(_models.build(_models.hf_config(spec), 0, 1), full)
    ids = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(3))
    got = _models.prefill_logits(m, spec, ids, torch.float32)
    with torch.no_grad():
        want = _models.transformers_model(spec, full)(ids[None]).logits[0, -1].float()
    assert (got - want).abs().max() <= 1e-4 * want.abs().max(), (got - want).abs().max()
    assert int(got.argmax()) == int(want.argmax())
