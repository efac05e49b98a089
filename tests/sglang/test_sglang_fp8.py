"""FP8 engines against SGLang's own: its quantizer (``per_block_cast_to_fp8``, DeepGEMM's, with
power-of-two scales) equals ``quant.fp8`` bit for bit, and SGLang's Qwen3 / Qwen3-MoE / DeepSeek-V3 classes
built with its block FP8 config (``Fp8Config``, 128 x 128) on CPU, loading a checkpoint that
SGLang's quantizer made from the full bf16 tensors through SGLang's own ``load_weights``, hold
exactly the tensors a shardsync FP8 engine rank holds: the names, shapes and dtypes of
``quant.targets`` and, bit for bit, the e4m3 weights and scales a receiver quantizes from its
shard (``receiver.quantized``) and a trainer from its own (``quant.wire``), at TP 1, 2 and 4 and
EP 2 (DeepSeek's MLA at TP 1 and 2)."""

from __future__ import annotations

import pytest
import torch

from shardsync.family.section import Latent
from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format, quantize, quantized
from tests.fp8_straddle import STRADDLE
from tests.sglang import _models

FMT = fp8_format("fp8-block128x128-ue8m0")  # SGLang's pure-torch quantizer rounds scales up to powers of two


def _weight(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.rand(shape[-2], 1, generator=g) * 0.1).to(torch.bfloat16)


@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (128, 128)])
def test_quantizer_equals_sglang_per_block_cast(shape: tuple[int, int]) -> None:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    w = _weight(*shape, seed=sum(shape))
    theirs_q, theirs_s = per_block_cast_to_fp8(w)
    q, s = quantize(w, FMT)
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)) and torch.equal(s, theirs_s)


def test_quantizer_equals_sglang_expert_stacks() -> None:
    from sglang.srt.layers.quantization.fp8_utils import quant_weight_ue8m0

    w = _weight(4, 256, 384, seed=4)
    theirs_q, theirs_s = quant_weight_ue8m0(w, [128, 128])
    q, s = quantize(w, FMT)
    assert torch.equal(q.view(torch.uint8), theirs_q.view(torch.uint8)) and torch.equal(s, theirs_s)


# What SGLang's DeepSeek attention derives from ``kv_b_proj`` and its block scales after a load
# (``post_load_weights``): the absorbed key and value weights re-quantized per tensor, and that
# scale.  Not parameters: a load through the parameters alone leaves them stale, so an FP8
# SGLang host must recompute them after every sync (docs/fp8.md; the host refuses FP8 so far).
MLA_DERIVED = ("w_kc", "w_vc", "w_scale")

WORLDS = [("tiny-qwen3-fp8", tp, 1) for tp in (1, 2, 4)] + \
         [("tiny-qwen3-moe-fp8", tp, ep) for tp, ep in ((1, 1), (2, 1), (4, 1), (2, 2))] + \
         [("tiny-deepseek-v3-fp8", tp, ep) for tp, ep in ((1, 1), (2, 1), (2, 2))] + \
         [(m, tp, ep) for m in ("tiny-deepseek-v32-fp8", "tiny-glm5-fp8") for tp, ep in ((1, 1), (2, 2))] + \
         [("tiny-qwen3-next-fp8", tp, ep) for tp, ep in ((1, 1), (2, 1), (2, 2))] + \
         [("tiny-qwen3.5-moe-fp8", tp, 1) for tp in (1, 2)]


@pytest.mark.parametrize(("model", "tp", "ep"), WORLDS, ids=lambda v: str(v))
def test_sglang_fp8_classes_hold_what_a_shardsync_fp8_rank_quantizes(model: str, tp: int, ep: int) -> None:
    from sglang.srt.layers.quantization.fp8_utils import per_block_cast_to_fp8

    spec = PRESETS[model]
    seeded = random_source(spec, seed=11)
    full = {n: seeded(n).to(torch.bfloat16) for n in logical_tensors(spec)}
    ckpt = _models.fp8_checkpoint(full, per_block_cast_to_fp8, _models.fp8_names(spec))
    config = _models.fp8_config(spec)
    lay = engine_layout(spec, EngineParallel(tp=tp, ep=ep, dtype="bfloat16"))
    for rank in range(tp):
        m = _models.build(_models.hf_config(spec), rank, tp, torch.bfloat16, ep_size=ep, quant_config=config)
        _models.sglang_load(m, ckpt)
        # SGLang's FP8 config gives MLA's attention KV-cache scales (``attn_mha.k_scale`` ...): 1.0
        # unless a checkpoint carries them, the FP8 KV cache's, not weights; nothing syncs them
        theirs = {n: p for n, p in m.named_parameters() if not n.endswith((".k_scale", ".v_scale"))}
        targets = quantized(lay.ranks[rank], spec, FMT)
        shard = load_rank(lay, rank, lambda n: full[n])
        mine: dict[str, torch.Tensor] = {}
        for t in lay.ranks[rank].tensors:
            target = targets.get(t.name)
            if target is None:
                mine[t.name] = shard[t.name].view(t.stored)
            else:
                mine[t.name], mine[target.scale] = quantize(shard[t.name].view(target.shape), FMT)
        assert {n: (tuple(p.shape), p.dtype) for n, p in theirs.items()} == \
               {n: (tuple(p.shape), p.dtype) for n, p in mine.items()}, (tp, ep, rank)
        bad = [n for n, p in theirs.items()
               if not torch.equal(p.data.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p.data,
                                  mine[n].view(torch.uint8) if p.dtype == torch.float8_e4m3fn else mine[n])]
        assert bad == [], (tp, ep, rank, bad[:4])
        assert len(targets) > 0
        lat = spec.find(Latent)
        if lat is not None and lat.q_lora_rank is not None:  # MLA: state SGLang derives after loading, beside params
            attn = m.model.layers[1].self_attn
            assert all(getattr(attn, n) is not None for n in MLA_DERIVED), MLA_DERIVED
            assert attn.w_kc.dtype == torch.float8_e4m3fn


# -- a trainer syncs SGLang serving a block FP8 checkpoint (the host: engines/sglang) --

TOKEN = "sglang-fp8-token-0123456789abcdef"
FP8_SYNCS = [("tiny-qwen3-fp8", "tp2"), ("tiny-qwen3-moe-fp8", "tp2"), ("tiny-deepseek-v3-fp8", "tp2"),
             ("tiny-deepseek-v32-fp8", "tp2"), ("tiny-qwen3-next-fp8", "tp2"), ("tiny-qwen3.5-moe-fp8", "tp2"),
             ("tiny-qwen3-fp8-straddle", "tp2")]
# STRADDLE: the TP 2 trainer's shards cut q_proj's and o_proj's middle blocks, which arrive wide
# and the host quantizes them into SGLang's parameters, the rest arrive quantized (SGLang TP 1 only)


def _spec(model: str):
    return STRADDLE if model == STRADDLE.name else PRESETS[model]


def _fp8_trainer(rank: int, world: int, port: int, model: str, urls: list[str], out) -> None:
    import httpx
    import torch.distributed as dist

    from shardsync.config import ControlConfig, SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.sync import WeightSync
    from tests.dist._world import join_trainer
    from tests.vllm._check import version_source

    spec = _spec(model)
    par = MegatronParallel(tp=world, dtype="bfloat16")  # a bf16 trainer, as RL runs train
    lay, params = join_trainer(rank, world, port, spec, par, seed=0)
    cfg = SyncConfig(control=ControlConfig(channel="sglang", token=TOKEN), detail=True,
                     transport=TransportConfig(bucket_mb=0.25, timeout_s=60))
    sync = WeightSync(spec, par, rank, params, urls, cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    assert sync.topo is not None and sync.topo.fp8 is not None
    res = {"connected": sync.mode.value, "fallback": sync.fallback_reason, "steps": [],
           "split": len(sync.topo.fp8.split)}
    for version, mode in ((1, None), (2, "broadcast")):
        for k, v in load_rank(lay, rank, version_source(spec, version)).items():
            params[k].copy_(v)
        rec = sync.update(version, mode=mode)
        step = {"mode": rec.mode, "ok": rec.ok, "error": rec.error, "engines": rec.engines_json(),
                "quantized_changed": rec.quantized_changed, "mismatched": sync.verify()}
        if rank == 0:
            step["sglang"] = [httpx.post(u + "/fake/compare", json={"version": version},
                                         timeout=120).json()["mismatched"] for u in urls]
        res["steps"].append(step)
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize(("model", "trainer"), FP8_SYNCS)
def test_a_trainer_syncs_sglang_serving_block_fp8(model: str, trainer: str) -> None:
    """SGLang TP 1 and TP 2 serving a 128 x 128 block FP8 checkpoint (``--quantization fp8``): a
    trainer TP 2 connects p2p, sends the e4m3 bytes and scales it quantized, and after p2p and
    broadcast updates every rank's parameters (and DeepSeek's absorbed ``w_kc`` / ``w_vc`` /
    ``w_scale``, derived after each update) equal, bit for bit, SGLang's own load of the FP8
    checkpoint of the trainer's full weights; the checksums agree."""
    import multiprocessing as mp

    from tests.dist._world import free_port, run_world
    from tests.sglang.fake_server import FakeSglang, fp8_quantizer
    from tests.vllm._check import version_source

    spec = _spec(model)
    tps = (1,) if spec is STRADDLE else (1, 2)
    full = {n: version_source(spec, 0)(n).to(torch.bfloat16) for n in logical_tensors(spec)}
    initial = _models.fp8_checkpoint(full, fp8_quantizer(), _models.fp8_names(spec))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_models.PRELOAD)
    started = [FakeSglang(spec, tp, initial, env={"SHARDSYNC_TOKEN": TOKEN}, ctx=ctx, quantization="fp8",
                          dtype="bfloat16") for tp in tps]
    try:
        results = run_world(_fp8_trainer, 2, args=(2, free_port(), model, [s.url for s in started]), timeout=400)
    finally:
        for s in started:
            s.stop()
    r0 = results[0]
    assert r0["connected"] == "p2p", r0["fallback"]
    for step in r0["steps"]:
        assert step["ok"] and step["mismatched"] == [], (step["mode"], step["error"], step["mismatched"][:4])
        assert step["sglang"] == [[[]] * tp for tp in tps], (step["mode"], step["sglang"])
        assert all(e["destination"] == "quantized" for e in step["engines"])
    assert r0["steps"][0]["quantized_changed"] > 0
    assert r0["split"] == (2 * spec.num_layers if spec is STRADDLE else 0)  # q_proj and o_proj in cells


def _fp8_host(model: str, config=None, tp: int = 2):
    from shardsync.engines.sglang.host import SglangHost

    spec = PRESETS[model]
    return SglangHost(_models.build(_models.hf_config(spec), 1, tp, torch.float32,
                                    quant_config=config or _models.fp8_config()))


def test_the_host_receives_fp8_in_place_and_refuses_what_it_cannot_write(monkeypatch) -> None:
    """SGLang's block FP8 parameters are the receive's destination (e4m3 and scales in place, no
    model-dtype copy before a connection says which weights arrive wide); per-tensor FP8 (an
    online quantization), a layout that needs SGLang's loader, and AMX-packed CPU weights are
    refused with the reason the trainer reads."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config

    h = _fp8_host("tiny-qwen3-fp8")
    assert h.problem is None and h.served.fmt == fp8_format("fp8")
    rx = h._receiver(False)
    dest = rx.destination
    assert dest.name == "quantized" and dest._wide == {}  # nothing allocated before a connection binds
    name = "model.layers.0.self_attn.qkv_proj.weight_scale_inv"
    param = h.model.get_parameter(name)
    param.data = torch.zeros_like(param.data)  # SGLang rebinds a scale: the receive follows it
    assert h.follow_params() and rx.destination is dest and dest.inner.tensors()[name].data_ptr() == param.data_ptr()
    online = Fp8Config(is_checkpoint_fp8_serialized=False, activation_scheme="dynamic")
    assert "weight blocks None" in _fp8_host("tiny-qwen3-fp8", online).problem
    monkeypatch.setenv("SHARDSYNC_SGLANG_LAYOUT", "whole")
    assert "receives shards in place only" in _fp8_host("tiny-qwen3-fp8").problem
    monkeypatch.delenv("SHARDSYNC_SGLANG_LAYOUT")
    m = _models.build(_models.hf_config(PRESETS["tiny-qwen3-fp8"]), 0, 1, torch.float32,
                      quant_config=_models.fp8_config())
    m.model.layers[0].self_attn.qkv_proj.use_intel_amx_backend = True  # as SGLang's CPU build marks a packed linear
    from shardsync.engines.sglang.host import SglangHost

    assert "AMX" in SglangHost(m).problem
