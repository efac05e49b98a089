"""SGLang's real model classes for one TP rank, built on CPU in one process without
``torch.distributed``: the rank reads its partition from SGLang's published runtime
context, as SGLang's own layer tests do.  Groups are placement-only stand-ins (named so):
nothing here communicates."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

MODELS = {  # HF architecture -> SGLang module
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2",
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
}
PRELOAD = ["torch", "transformers", "shardsync.receiver", "shardsync.engines.sglang", *MODELS.values()]


class StandInGroup(SimpleNamespace):
    """A group coordinator's placement fields only (rank, size); any communication fails."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank_in_group=rank, world_size=size, ranks=list(range(size)), is_first_rank=rank == 0,
                         is_last_rank=rank == size - 1, first_rank=0, last_rank=size - 1, local_rank=rank,
                         cpu_group=None, device_group=None)

    def __getattr__(self, name: str):
        raise AttributeError(f"stand-in group has no {name!r}: nothing communicates in these tests")


def publish_rank(tp_rank: int, tp_size: int, dtype: str, loaders: tuple[str, ...] = ()):
    """Publish this process's SGLang context as TP rank ``tp_rank`` of ``tp_size`` (last
    publish wins); returns the ``ServerArgs``."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = ServerArgs(model_path="dummy", tp_size=tp_size, device="cpu", dtype=dtype,
                      custom_weight_loader=list(loaders) or None)
    publish(args, role="test", ranks=SpawnRanks(world_rank=tp_rank))
    tp, one = StandInGroup(tp_rank, tp_size), StandInGroup(0, 1)
    # as SGLang's initialize_model_parallel aliases them when the widths match
    get_parallel().override_permanently(tp_group=tp, attn_tp_group=tp, moe_tp_group=tp, pp_group=one,
                                        moe_ep_group=tp if tp_size == 1 else one,
                                        moe_dp_group=tp if tp_size == 1 else one, attn_cp_group=one)
    return args


def build(hf_config, tp_rank: int, tp_size: int, dtype: torch.dtype = torch.float32,
          loaders: tuple[str, ...] = ()) -> torch.nn.Module:
    """SGLang's model of ``hf_config`` as TP rank ``tp_rank`` holds it (weights uninitialized)."""
    import sglang.srt.layers.rotary_embedding.base as rope

    rope._is_cpu = True  # its CUDA path imports vllm's custom ops; the native one is exact
    publish_rank(tp_rank, tp_size, str(dtype).removeprefix("torch."), loaders)
    (arch,) = hf_config.architectures
    cls = getattr(importlib.import_module(MODELS[arch]), arch)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cpu"):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def sglang_load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """SGLang's own ``load_weights`` from full HF tensors (each layer keeps its TP shard)."""
    with torch.no_grad():
        model.load_weights(iter(list(tensors.items())))
    return model


def hf_config(spec):
    """The transformers config of a shardsync spec, with its architecture."""
    import transformers

    cfg = spec.to_hf_config()
    out = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    out.architectures = list(cfg["architectures"])
    return out
