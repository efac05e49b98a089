"""Our Megatron layout against real megatron-core ``GPTModel``s built on CPU.

Every (tp, pp) world builds the tiny presets with the local layer spec (separate norm
modules, ``norm_names="separate"``) under a gloo group and reports each rank's
``named_parameters()``; the layout's local tensor names and shapes must equal them, and
Megatron's (tp, pp) rank coordinates must equal the layout's rank order.

The TE spec (``norm_names="fused"``) needs transformer_engine, which is not installed for
the CPU test run, so only the local spec is checked here.
"""

from __future__ import annotations

import importlib.util
import warnings
from datetime import timedelta
from unittest import mock

import pytest

from shardsync.layout import MegatronParallel, megatron_layout
from shardsync.spec import PRESETS, ModelSpec
from tests.dist._world import free_port, run_world
from tests.megatron_recipe import architecture


PRESET_NAMES = ("tiny-qwen2", "tiny-qwen3", "tiny-llama")
GRID = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, pp); world size tp * pp
WORLD_TIMEOUT_S = 180


def _gpt_model(spec: ModelSpec, par: MegatronParallel, *, pre_process: bool, post_process: bool):
    """A real mcore GPTModel for ``spec`` with the flags a Qwen2/Qwen3/Llama trainer uses."""
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    dtype = getattr(torch, spec.dtype)
    config = TransformerConfig(
        **architecture(spec),
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        # pp > 1 refuses a config without pipeline_dtype.
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Without it mcore allocates weights on torch.cuda.current_device().
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    layer_spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=spec.qk_norm)
    scaling = spec.rope_scaling or {}
    # Tied embeddings with pp > 1: mcore moves the last stage's embedding copy to CUDA
    # (``weight.data.cuda()`` in LanguageModule.setup_embeddings_and_output_layer) before
    # all-reducing it over the embedding group.  On CPU keep it in place; the all-reduce
    # itself still runs over gloo.
    with mock.patch.object(torch.Tensor, "cuda", lambda self, *a, **k: self):
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=par.padded_vocab(spec.vocab_size),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta),
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
