"""SGLang's real model classes for one TP rank, built on CPU in one process without
``torch.distributed``: the rank reads its partition from SGLang's published runtime
context, as SGLang's own layer tests do.  Groups are placement-only stand-ins (named so):
nothing here communicates."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from shardsync.family.section import Latent

MODELS = {  # HF architecture -> SGLang module
    "Qwen3ForCausalLM": "sglang.srt.models.qwen3",
    "Qwen2ForCausalLM": "sglang.srt.models.qwen2",
    "LlamaForCausalLM": "sglang.srt.models.llama",
    "Qwen3MoeForCausalLM": "sglang.srt.models.qwen3_moe",
    "DeepseekV3ForCausalLM": "sglang.srt.models.deepseek_v2",
    "DeepseekV32ForCausalLM": "sglang.srt.models.deepseek_v2",
    "GlmMoeDsaForCausalLM": "sglang.srt.models.glm4_moe",  # SGLang's DeepSeek class under GLM's name
    "Qwen3NextForCausalLM": "sglang.srt.models.qwen3_next",
    "Qwen3_5MoeForCausalLM": "sglang.srt.models.qwen3_5_text",  # the text model of the Qwen3.5 checkpoints
}
# model types whose SGLang class reads SGLang's own config class (Qwen3-Next: its layers_block_type,
# from full_attention_interval; transformers' class has no such field)
CONFIGS = {"qwen3_next": ("sglang.srt.configs.qwen3_next", "Qwen3NextConfig"),
           "qwen3_5_moe_text": ("sglang.srt.configs.qwen3_5", "Qwen3_5MoeTextConfig")}
# tensors SGLang derives from loaded ones after loading (MLA: w_kc / w_vc from kv_b_proj; zero-centred
# norms: gemma_weight = weight + 1, a buffer), per module
DERIVED = ("w_kc", "w_vc", "w_scale", "gemma_weight")

def _specs():
    from shardsync.presets import PRESETS

    # SGLang's Qwen3-MoE makes every layer sparse and its lm_head its own (it reads neither
    # ``mlp_only_layers`` nor ``tie_word_embeddings``; released Qwen3-MoE checkpoints use neither)
    moe = PRESETS["tiny-qwen3-moe"].replace(mlp_only_layers=(), tie_word_embeddings=False)
    # SGLang's CPU rotary takes DeepSeek's yarn only (it asserts a scaling dict): GLM-5's default rope
    # becomes yarn here, which changes no parameter
    glm5 = PRESETS["tiny-glm5"].replace(rope_scaling=PRESETS["tiny-deepseek-v3"].rope_scaling)
    return {**{m: PRESETS[m] for m in ("tiny-qwen3", "tiny-qwen2", "tiny-llama")}, "tiny-qwen3-moe": moe,
            "tiny-deepseek-v3": PRESETS["tiny-deepseek-v3"], "tiny-deepseek-v32": PRESETS["tiny-deepseek-v32"],
            "tiny-glm5": glm5, "tiny-qwen3-next": PRESETS["tiny-qwen3-next"],
            "tiny-qwen3.5-moe": PRESETS["tiny-qwen3.5-moe"]}


# q/k norms; bias + tied embeddings; 4 KV heads; experts (triton layout); latent attention, shared
# experts, a sigmoid router and the derived w_kc / w_vc; sparse attention's indexer (DeepSeek-V3.2's
# and GLM-5's); Qwen3-Next's gated DeltaNet and gated attention
SPECS = _specs()
NO_PP = {"tiny-qwen3-next"}  # SGLang's Qwen3-Next asserts a single pipeline stage
MLA = tuple(m for m, s in SPECS.items() if s.find(Latent) is not None)


def derived(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors SGLang computed from loaded weights (they are attributes, not parameters)."""
    out = {}
    for name, module in model.named_modules():
        for attr in DERIVED:
            t = module.__dict__.get(attr, module._buffers.get(attr))
            if isinstance(t, torch.Tensor):
                out[f"{name}.{attr}"] = t
    return out
PRELOAD = ["torch", "transformers", "shardsync.receiver", "shardsync.engines.sglang", *MODELS.values()]


class StandInGroup(SimpleNamespace):
    """A group coordinator's placement fields only (rank, size); any communication fails."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank_in_group=rank, world_size=size, ranks=list(range(size)), is_first_rank=rank == 0,
                         is_last_rank=rank == size - 1, first_rank=0, last_rank=size - 1, local_rank=rank,
                         cpu_group=None, device_group=None)

    def __getattr__(self, name: str):
        raise AttributeError(f"stand-in group has no {name!r}: nothing communicates in these tests")


def publish_rank(tp_rank: int, tp_size: int, dtype: str, loaders: tuple[str, ...] = (), pp_rank: int = 0,
                 pp_size: int = 1, ep_size: int = 1):
    """Publish this process's SGLang context as TP rank ``tp_rank`` of ``tp_size`` in stage
    ``pp_rank`` of ``pp_size``, experts over ``ep_size`` (last publish wins); returns the ``ServerArgs``."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    args = ServerArgs(model_path="dummy", tp_size=tp_size, pp_size=pp_size, ep_size=ep_size, device="cpu",
                      dtype=dtype, custom_weight_loader=list(loaders) or None)
    publish(args, role="test", ranks=SpawnRanks(world_rank=pp_rank * tp_size + tp_rank))
    tp, moe_tp = StandInGroup(tp_rank, tp_size), tp_size // ep_size
    # as SGLang's initialize_model_parallel aliases them when the widths match
    moe = {"moe_tp_group": StandInGroup(tp_rank % moe_tp, moe_tp) if moe_tp < tp_size else tp,
           "moe_ep_group": StandInGroup(tp_rank // moe_tp, ep_size) if ep_size < tp_size else tp}
    get_parallel().override_permanently(tp_group=tp, attn_tp_group=tp, pp_group=StandInGroup(pp_rank, pp_size),
                                        moe_dp_group=tp if tp_size == 1 else StandInGroup(0, 1),
                                        attn_cp_group=StandInGroup(0, 1), **moe)
    return args


def build(hf_config, tp_rank: int, tp_size: int, dtype: torch.dtype = torch.float32,
          loaders: tuple[str, ...] = (), pp_rank: int = 0, pp_size: int = 1, ep_size: int = 1,
          shared_fused: bool = False, indexer_fused: bool = False, quant_config=None) -> torch.nn.Module:
    """SGLang's model of ``hf_config`` as TP rank ``tp_rank`` of stage ``pp_rank`` holds it
    (weights uninitialized); ``shared_fused``: the shared expert fused into the routed ones, as
    SGLang decides on CUDA sm80+ at EP 1; ``indexer_fused``: the sparse-attention indexer's
    ``wk_weights_proj``, as SGLang decides on CUDA for an interleaved indexer rotary (both forced
    here, the layout only: CPU cannot run them); ``quant_config``: SGLang's quantization config
    (an ``Fp8Config``: its FP8 linear and MoE methods create e4m3 weights and their scales)."""
    import sglang.srt.layers.attention.dsa.dsa_indexer as indexer
    import sglang.srt.layers.rotary_embedding.base as rope
    import sglang.srt.models.qwen2_moe as qwen2_moe
    from sglang.srt.configs.shared_experts import SharedExpertsConfig
    from sglang.srt.runtime_context import get_model

    rope._is_cpu = True  # its CUDA path imports vllm's custom ops; the native one is exact
    publish_rank(tp_rank, tp_size, str(dtype).removeprefix("torch."), loaders, pp_rank, pp_size, ep_size)
    (arch,) = hf_config.architectures
    cls = getattr(importlib.import_module(MODELS[arch]), arch)
    shared = SharedExpertsConfig(num_fused_shared_experts=int(shared_fused))
    before, cuda, sms = torch.get_default_dtype(), indexer._is_cuda, indexer.resolve_num_sms
    device_module, moe_cuda = torch.get_device_module, qwen2_moe._is_cuda
    qwen2_moe._is_cuda = shared_fused  # Qwen3-Next's sparse block fuses its shared expert on CUDA only
    torch.set_default_dtype(dtype)
    if indexer_fused:  # the gate SGLang reads at construction; the SM count its CUDA path asks for
        indexer._is_cuda, indexer.resolve_num_sms = True, lambda: 132
    # stand-in: Qwen3-Next's gated norm asks the accelerator module for its current device
    torch.get_device_module = lambda *args, **kwargs: torch.cpu
    try:
        with torch.device("cpu"), get_model().override(shared_experts=shared):
            model = cls(hf_config) if quant_config is None else cls(hf_config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(before)
        indexer._is_cuda, indexer.resolve_num_sms = cuda, sms
        torch.get_device_module, qwen2_moe._is_cuda = device_module, moe_cuda
    model.shared_experts_config = shared  # as SGLang's loader keeps it on the model
    return model.eval()


def fp8_config(spec=None):
    """SGLang's config of a 128 x 128 block FP8 checkpoint (DeepSeek-V3's, Qwen3-FP8's) of ``spec``:
    Qwen3-Next's lists each linear-attention ``in_proj_ba`` among its unquantized modules (its
    rows are no whole block), as the released checkpoints do."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    ba = {"gdn": ("in_proj_ba",), "gdn_stacked": ("in_proj_b", "in_proj_a")}
    ignored = [] if spec is None else [f"model.layers.{i}.linear_attn.{m}" for i in range(spec.num_layers)
                                       for m in ba.get(spec.family_table.blocks(spec, i)[0].kind, ())]
    return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128],
                     ignored_layers=ignored)


def fp8_names(spec) -> frozenset[str]:
    """The checkpoint tensors an FP8 checkpoint of ``spec`` holds in e4m3: those of every engine
    tensor an FP8 engine quantizes (``quant.targets``; the family tables' ``fp8`` rows)."""
    from shardsync.layout import EngineParallel, engine_layout
    from shardsync.quant import fp8_format, quantized

    rank = engine_layout(spec, EngineParallel(tp=1, dtype=spec.dtype)).ranks[0]
    targets = quantized(rank, spec, fp8_format("fp8"))
    return frozenset(p.logical for p in rank.pieces if p.local in targets)


def fp8_checkpoint(full: dict[str, torch.Tensor], quantize, names: frozenset[str]) -> dict[str, torch.Tensor]:
    """An FP8 checkpoint of ``full``: the tensors ``names`` in e4m3 with their ``weight_scale_inv``
    made by ``quantize`` (a tensor -> e4m3, scales), the rest as they are."""
    out = {}
    for name, t in full.items():
        if name in names:
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = quantize(t)
        else:
            out[name] = t
    return out


def sglang_load(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    """SGLang's own ``load_weights`` from full HF tensors (each layer keeps its TP shard)."""
    with torch.no_grad():
        model.load_weights(iter(list(tensors.items())))
    return model


def hf_config(spec):
    """The transformers config of a shardsync spec, with its architecture (a new object each
    time: SGLang's DeepSeek class rewrites the config's rope type in place)."""
    import transformers

    cfg = spec.to_hf_config()
    fields = {k: v for k, v in cfg.items() if k != "architectures"}
    if cfg["model_type"] in CONFIGS:
        module, name = CONFIGS[cfg["model_type"]]
        out = getattr(importlib.import_module(module), name)(**fields)
    else:
        out = transformers.AutoConfig.for_model(**fields)
    out.architectures = list(cfg["architectures"])
    return out


def prefill_logits(model: torch.nn.Module, spec, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SGLang's own forward of one prompt at TP 1 (its torch-native attention backend, a token
    KV pool built here): the last token's logits over the real vocab."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    n = len(ids)
    req_to_token = ReqToTokenPool(size=1, max_context_len=n + 8, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=n + 8, page_size=1, dtype=dtype, head_num=spec.num_kv_heads, head_dim=spec.head_dim,
                          layer_num=spec.num_layers, device="cpu", enable_memory_saver=False, enable_alt_stream=False)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu", req_to_token_pool=req_to_token, token_to_kv_pool=kv))
    slots = torch.arange(1, n + 1)
    req_to_token.req_to_token[0, :n] = slots
    one = torch.tensor([n], dtype=torch.int32)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=ids,
                         req_pool_indices=torch.tensor([0], dtype=torch.int32), seq_lens=one, seq_lens_cpu=one,
                         out_cache_loc=slots, seq_lens_sum=n, positions=torch.arange(n))
    batch.extend_prefix_lens, batch.extend_prefix_lens_cpu = torch.tensor([0], dtype=torch.int32), [0]
    batch.extend_seq_lens, batch.extend_seq_lens_cpu, batch.extend_num_tokens = one, [n], n
    batch.return_logprob, batch.capture_hidden_mode = False, CaptureHiddenMode.NULL
    pages = SimpleNamespace(page_size=1, get_kvcache=lambda: kv)
    KVIndexTranslator(req_to_token=req_to_token.req_to_token, token_to_kv_pool_allocator=pages, token_to_kv_pool=kv,
                      page_size=1, device="cpu", is_draft_worker=False).bind_own_plan(batch)
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        backend.init_forward_metadata(batch)
        out = model.forward(ids, batch.positions, batch)
    return out.next_token_logits[0, :spec.vocab_size].float()


def transformers_model(spec, full: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``transformers``' model holding ``full`` (HF checkpoint names; transformers 5 keeps a
    MoE layer's experts stacked in memory)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            pre = name.split("experts.")[0]
            if name.endswith("experts.gate_up_proj"):
                t = torch.stack([torch.cat([full[f"{pre}experts.{e}.gate_proj.weight"],
                                            full[f"{pre}experts.{e}.up_proj.weight"]])
                                 for e in range(spec.num_experts)])
            elif name.endswith("experts.down_proj"):
                t = torch.stack([full[f"{pre}experts.{e}.down_proj.weight"] for e in range(spec.num_experts)])
            else:
                t = full["model.embed_tokens.weight" if name == "lm_head.weight" and spec.tie_word_embeddings else name]
            param.copy_(t)
    return model
