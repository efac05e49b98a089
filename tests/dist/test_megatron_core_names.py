"""Our Megatron layout against real megatron-core ``GPTModel``s built on CPU.

Every (tp, pp) world builds the tiny presets with the local layer spec (separate norm
modules, ``norm_names="separate"``) under a gloo group and reports each rank's
``named_parameters()``; the layout's local tensor names and shapes must equal them, and
Megatron's (tp, pp) rank coordinates must equal the layout's rank order.

The MoE preset (tiny-qwen3-moe: layer 0 dense, layers 1-3 with 8 experts) is built the
same way over (tp, pp, dp, ep, etp) worlds with SequentialMLP experts
(``expert_names="sequential"``); there the expert rank coordinates and the global experts
each rank holds (``MoELayer.local_expert_indices``) must match the layout too.

The MLA presets (tiny-deepseek-v3 with a q down projection and an MTP layer, -q-proj without,
tiny-glm4-moe-lite) build the same way with ``MLATransformerConfig`` (and megatron-core's MTP
block: ``mtp.layers.{k}`` on the last stage) and three stand-ins (no CUDA device, no
TELinear, a parameter-free core attention: the local ``DotProductAttention`` refuses MLA's
``k_channels``); their down projections are column-parallel in the local spec.

The TE spec (``norm_names="fused"``) needs transformer_engine, which is not installed for
the CPU test run, so only the local spec is checked here.
"""

from __future__ import annotations

import importlib.util
import warnings
from datetime import timedelta
from unittest import mock

import pytest

from shardsync.family.section import Indexer, Latent
from shardsync.layout import MegatronParallel, megatron_layout
from shardsync.layout.logical import mtp_layers
from shardsync.spec import ModelSpec
from shardsync.presets import PRESETS
from tests.dist._world import free_port, run_world
from tests.megatron_recipe import architecture, moe_architecture


PRESET_NAMES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama")
GRID = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, pp); world size tp * pp
WORLD_TIMEOUT_S = 180


def _moe_config(spec: ModelSpec, par: MegatronParallel) -> dict:
    """TransformerConfig fields of a Qwen3-MoE trainer (empty for a dense spec)."""
    if not spec.is_moe:
        return {}
    # allgather dispatcher: the alltoall one creates a CUDA stream in its constructor
    return dict(
        **moe_architecture(spec),
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        # No sequence_parallel: MoELayer.forward wants it for training with tp > 1, but the local
        # spec's torch norms (no apex here) refuse it at construction; names/shapes don't depend on it.
    )


class _NoCoreAttention:
    """A parameter-free stand-in for MLA's core attention (names and shapes only)."""

    def __new__(cls, *args, **kwargs):
        import torch

        return torch.nn.Identity()


class _DuplicatedLinear:
    """A stand-in for transformer_engine's TELinear in ``parallel_mode="duplicated"`` (TE is not
    installed here): the full ``[out, in]`` weight on every TP rank, as TE holds it."""

    def __new__(cls, input_size: int, output_size: int, *, parallel_mode: str, config, **kwargs):
        import torch

        assert parallel_mode == "duplicated", parallel_mode
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
        return module


class _KeyNorm:
    """A stand-in for TENorm as the DSA indexer's key LayerNorm (weight and bias)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        import torch

        return torch.nn.LayerNorm(hidden_size, eps=eps)


def _sparse_core_attention():
    """megatron-core 0.16.1's own DSA core attention and indexer (its spec helper needs TE, and its
    dispatcher does not know ``dsa`` before 0.18), with the TE pieces stood in."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (
        DSAIndexer,
        DSAIndexerSubmodules,
        DSAttention,
        DSAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=_DuplicatedLinear, linear_wk=_DuplicatedLinear, k_norm=_KeyNorm,
        linear_weights_proj=_DuplicatedLinear))
    return ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))


def _gpt_model(spec: ModelSpec, par: MegatronParallel, *, pre_process: bool, post_process: bool):
    """A real mcore GPTModel for ``spec`` with the flags a Qwen2/Qwen3/Llama/Qwen3-MoE trainer uses."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    dtype = getattr(torch, spec.dtype)
    config = (MLATransformerConfig if spec.find(Latent) is not None else TransformerConfig)(
        **architecture(spec),
        **_moe_config(spec, par),
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        mtp_num_layers=spec.num_nextn_predict_layers or None,
        # pp > 1 refuses a config without pipeline_dtype.
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Without it mcore allocates weights on torch.cuda.current_device().
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    if spec.is_moe:
        # This stage's slice of the per-layer dense/MoE local specs (config.moe_layer_freq).
        layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
        if spec.find(Latent) is not None:  # stand-in: the local DotProductAttention refuses MLA's k_channels
            core = _sparse_core_attention() if spec.find(Indexer) is not None else _NoCoreAttention
            for layer in layer_spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = core
    else:
        layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    scaling = spec.rope_scaling or {}
    # Tied embeddings with pp > 1: mcore moves the last stage's embedding copy to CUDA
    # (``weight.data.cuda()`` in LanguageModule.setup_embeddings_and_output_layer) before
    # all-reducing it over the embedding group.  On CPU keep it in place; the all-reduce
    # itself still runs over gloo.
    # The sigmoid router allocates its expert_bias buffer on torch.cuda.current_device(): CPU here.
    # MLA tests isinstance(..., TELinear) with TELinear None when transformer_engine is missing
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self), \
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch("megatron.core.transformer.multi_latent_attention.HAVE_TE", False):
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=par.padded_vocab(spec.vocab_size),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            # the MTP layers: the decoder's last layer spec behind megatron-core's MTP head (last stage)
            mtp_block_spec=get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=False)
            if spec.num_nextn_predict_layers and post_process else None,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
            rotary_percent=spec.partial_rotary_factor,
            rope_scaling=scaling.get("rope_type") == "llama3",
            rope_scaling_factor=float(scaling.get("factor", 8.0)),
        )


def _worker(rank: int, world: int, port: int, tp: int, pp: int, presets: tuple[str, ...], out) -> None:
    """One rank: build every preset, report Megatron's coordinates and parameter shapes."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    try:
        from megatron.core import parallel_state as mpu

        mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        try:
            par = MegatronParallel(tp=tp, pp=pp)
            first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
            params = {}
            for name in presets:
                model = _gpt_model(PRESETS[name], par, pre_process=first, post_process=last)
                params[name] = {
                    n: tuple(p.shape) for n, p in model.named_parameters()
                    if not n.endswith("._extra_state")  # LAYOUTS.md §2.1
                }
            coords = (mpu.get_pipeline_model_parallel_rank(), mpu.get_data_parallel_rank(),
                      mpu.get_tensor_model_parallel_rank())
        finally:
            mpu.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    out.put((rank, {"coords": coords, "params": params}))


_WORLDS: dict[tuple[int, int], dict | Exception] = {}


def _megatron_world(tp: int, pp: int) -> dict:
    """Per-rank results of one (tp, pp) world; built once and shared by all presets."""
    key = (tp, pp)
    if key not in _WORLDS:
        try:
            _WORLDS[key] = run_world(_worker, tp * pp, args=(tp * pp, free_port(), tp, pp, PRESET_NAMES),
                                     timeout=WORLD_TIMEOUT_S)
        except Exception as e:  # don't rebuild a failing world once per preset
            _WORLDS[key] = e
    result = _WORLDS[key]
    if isinstance(result, Exception):
        pytest.fail(f"megatron-core world tp={tp} pp={pp} failed: {result}", pytrace=False)
    return result


def _diff(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]]) -> list[str]:
    lines = [f"  missing from the model (layout only): {n} {expected[n]}"
             for n in sorted(expected.keys() - got.keys())]
    lines += [f"  unexpected in the model (not in layout): {n} {got[n]}"
              for n in sorted(got.keys() - expected.keys())]
    lines += [f"  shape mismatch: {n} layout={expected[n]} model={got[n]}"
              for n in sorted(expected.keys() & got.keys()) if expected[n] != got[n]]
    return lines


@pytest.mark.parametrize("tp,pp", GRID, ids=[f"tp{t}pp{p}" for t, p in GRID])
@pytest.mark.parametrize("preset", PRESET_NAMES)
def test_layout_matches_megatron_core_named_parameters(preset: str, tp: int, pp: int) -> None:
    par = MegatronParallel(tp=tp, pp=pp, norm_names="separate")
    layout = megatron_layout(PRESETS[preset], par)
    world = _megatron_world(tp, pp)
    assert sorted(world) == list(range(par.world_size))
    problems = []
    for rank in range(par.world_size):
        rank_layout = layout.ranks[rank]
        coords = world[rank]["coords"]
        if coords != par.coords(rank):
            problems.append(f"rank {rank}: megatron (pp, dp, tp) = {coords}, "
                            f"layout {rank_layout.label} = {par.coords(rank)}")
        expected = {t.name: tuple(t.shape) for t in rank_layout.tensors}
        lines = _diff(expected, world[rank]["params"][preset])
        if lines:
            problems.append(f"rank {rank} ({rank_layout.label}):\n" + "\n".join(lines))
    assert not problems, (
        f"{preset} tp={tp} pp={pp}: layout differs from megatron-core named_parameters()\n"
        + "\n".join(problems)
    )


# ---------------------------------------------------------------------------------------------
# Mixture of experts

# (preset, tp, pp, dp, ep, etp); world size tp * pp * dp.  Covers ep 1/2, tp 1/2, etp = tp and
# etp != tp, pp 2, and expert-DP > 1 (etp * ep < tp * dp); GLM4-MoE (shared experts, the router's
# expert_bias buffer) in two of them.
MOE_WORLDS = (
    ("tiny-qwen3-moe", 1, 1, 2, 2, 1),
    ("tiny-qwen3-moe", 2, 1, 1, 1, 2),
    ("tiny-qwen3-moe", 2, 2, 1, 1, 2),
    ("tiny-qwen3-moe", 2, 1, 2, 2, 1),
    ("tiny-glm4-moe", 2, 1, 1, 2, 1),
    ("tiny-glm4-moe", 1, 2, 2, 2, 1),
    # multi-head latent attention: q down projection or q_proj, EP over TP and over DP, ETP 2
    ("tiny-deepseek-v3", 2, 1, 1, 2, 1),
    ("tiny-deepseek-v3", 1, 2, 1, 1, 1),  # its MTP layer on the last stage
    ("tiny-deepseek-v3-q-proj", 1, 2, 2, 2, 1),
    ("tiny-glm4-moe-lite", 2, 1, 1, 1, 2),
    ("tiny-glm4-moe+mtp", 2, 2, 1, 2, 1),  # GLM-4.5's MTP layer (grouped-query attention) on the last stage
    # sparse attention: megatron-core's own DSA indexer under core_attention, replicated over TP
    ("tiny-glm5", 2, 1, 1, 2, 1),
    ("tiny-deepseek-v32", 1, 2, 1, 1, 1),
)
# worlds of a preset with fields changed (GLM-4.5-Air's checkpoint has an MTP layer; its tiny preset not)
CHANGED = {"tiny-glm4-moe+mtp": ("tiny-glm4-moe", {"num_nextn_predict_layers": 1})}


def _spec(name: str) -> ModelSpec:
    base, changes = CHANGED.get(name, (name, {}))
    return PRESETS[base].replace(**changes)


def _moe_worker(rank: int, world: int, port: int, preset: str, par: MegatronParallel, out) -> None:
    """One rank: build the MoE preset, report Megatron's (expert) coordinates, parameter
    names/shapes in registration order and each MoE layer's global expert indices."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    try:
        from megatron.core import parallel_state as mpu
        from megatron.core.transformer.moe.moe_layer import MoELayer

        mpu.initialize_model_parallel(tensor_model_parallel_size=par.tp, pipeline_model_parallel_size=par.pp,
                                      expert_model_parallel_size=par.ep,
                                      expert_tensor_parallel_size=par.expert_tp)
        try:
            model = _gpt_model(_spec(preset), par, pre_process=mpu.is_pipeline_first_stage(),
                               post_process=mpu.is_pipeline_last_stage())
            params = [(n, tuple(p.shape)) for n, p in model.named_parameters()
                      if not n.endswith("._extra_state")]
            # the router's expert_bias is a buffer (updated by load balancing, not the optimizer): a sync
            # moves it all the same, so the layout lists it after the router weight
            for n, b in model.named_buffers():
                if n.endswith("router.expert_bias"):
                    params.insert(next(i for i, (m, _) in enumerate(params) if m == n.replace("expert_bias", "weight"))
                                  + 1, (n, tuple(b.shape)))
            experts = {n: list(m.local_expert_indices) for n, m in model.named_modules() if isinstance(m, MoELayer)}
            result = {
                "coords": (mpu.get_pipeline_model_parallel_rank(), mpu.get_data_parallel_rank(),
                           mpu.get_tensor_model_parallel_rank()),
                "expert_coords": (mpu.get_pipeline_model_parallel_rank(), mpu.get_expert_data_parallel_rank(),
                                  mpu.get_expert_model_parallel_rank(), mpu.get_expert_tensor_parallel_rank()),
                "params": params,
                "experts": experts,
            }
        finally:
            mpu.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    out.put((rank, result))


# Megatron registers ``self_attention.linear_proj`` first (Attention.__init__ builds it before
# SelfAttention.__init__ adds linear_qkv and the q/k norms); the layout lists it after them.
# Every other tensor -- router, then each local expert's fc1 and fc2, ascending -- must come in
# Megatron's registration order.
_ATTN_OUT = ".self_attention.linear_proj.weight"


def _order_problem(layout_names: list[str], model_names: list[str]) -> str | None:
    lay = [n for n in layout_names if not n.endswith(_ATTN_OUT)]
    mod = [n for n in model_names if not n.endswith(_ATTN_OUT)]
    if lay == mod:
        return None
    i = next((i for i, (a, b) in enumerate(zip(lay, mod)) if a != b), min(len(lay), len(mod)))
    return (f"registration order differs (ignoring {_ATTN_OUT}) at position {i}: "
            f"layout {lay[i:i + 3]} model {mod[i:i + 3]}")


def _moe_par(tp: int, pp: int, dp: int, ep: int, etp: int) -> MegatronParallel:
    return MegatronParallel(tp=tp, pp=pp, dp=dp, ep=ep, etp=etp, norm_names="separate", expert_names="sequential")


@pytest.mark.parametrize("preset,tp,pp,dp,ep,etp", MOE_WORLDS,
                         ids=[f"{m}-tp{t}pp{p}dp{d}ep{e}etp{x}" for m, t, p, d, e, x in MOE_WORLDS])
def test_moe_layout_matches_megatron_core(preset: str, tp: int, pp: int, dp: int, ep: int, etp: int) -> None:
    spec = _spec(preset)
    par = _moe_par(tp, pp, dp, ep, etp)
    layout = megatron_layout(spec, par)
    world = run_world(_moe_worker, par.world_size, args=(par.world_size, free_port(), preset, par),
                      timeout=WORLD_TIMEOUT_S)
    assert sorted(world) == list(range(par.world_size))
    n_local = spec.num_experts // ep
    problems = []
    for rank in range(par.world_size):
        rank_layout, got = layout.ranks[rank], world[rank]
        label = f"rank {rank} ({rank_layout.label})"
        if got["coords"] != par.coords(rank):
            problems.append(f"{label}: megatron (pp, dp, tp) = {got['coords']}, layout = {par.coords(rank)}")
        if got["expert_coords"] != par.expert_coords(rank):
            problems.append(f"{label}: megatron (pp, edp, ep, etp) = {got['expert_coords']}, "
                            f"layout = {par.expert_coords(rank)}")
        expected = [(t.name, tuple(t.shape)) for t in rank_layout.tensors]
        lines = _diff(dict(expected), dict(got["params"]))
        if lines:
            problems.append(f"{label}:\n" + "\n".join(lines))
        order = _order_problem([n for n, _ in expected], [n for n, _ in got["params"]])
        if order:
            problems.append(f"{label}: {order}")
        stage = par.stage_layers(spec.num_layers)[par.coords(rank)[0]]
        sparse = [f"decoder.layers.{local}.mlp" for local, layer in enumerate(stage) if spec.sparse_layer(layer)]
        if par.coords(rank)[0] == par.pp - 1:  # the MTP layers' experts, on the last stage
            sparse += [f"mtp.layers.{k}.transformer_layer.mlp" for k in range(len(mtp_layers(spec)))]
        ep_rank = par.expert_coords(rank)[2]
        want = {n: [ep_rank * n_local + j for j in range(n_local)] for n in sparse}
        if got["experts"] != want:
            problems.append(f"{label}: megatron local_expert_indices = {got['experts']}, layout = {want}")
    assert not problems, (
        f"{preset} tp={tp} pp={pp} dp={dp} ep={ep} etp={etp}: layout differs from megatron-core\n"
        + "\n".join(problems)
    )
