"""A shardsync trainer (TP 1, TP 2, PP 2; TP 2 EP 2 for DeepSeek-V3) syncs into SGLang's real
models (four engines at once: TP 1, 2 and 4, KV heads replicated at 4, and TP 2 x PP 2; for
DeepSeek-V3 also TP 2 EP 2 and TP 2 with SGLang's fused shared expert)
through SGLang's custom weight loader: p2p, broadcast and a 1 % delta.  After every update
each rank's parameters, and what SGLang derives from them (MLA's ``w_kc`` / ``w_vc``), equal,
bit for bit, what SGLang's own ``load_weights`` makes of the trainer's full tensors;
shardsync's checksums of what every rank holds equal the trainer's; the per-update calls are
SGLang's, O(1) per engine.  The server is a stand-in (``FakeSglang``: SGLang's server needs a
GPU build); models, loaders, schemas and the loader call path are SGLang's own."""

from __future__ import annotations

import multiprocessing as mp

import httpx
import pytest
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from shardsync.config import ControlConfig, DeltaConfig, SyncConfig, TransportConfig
from shardsync.family.section import Latent
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank
from shardsync.sync import WeightSync
from tests.dist._world import free_port, join_trainer, run_world
from tests.sglang import _models
from tests.sglang.fake_server import FakeSglang
from tests.vllm._check import version_source

TOKEN = "sglang-test-token-0123456789abcdef"  # SGLang's ranks read it from $SHARDSYNC_TOKEN
ENGINES = ((1, 1), (2, 1), (4, 1), (2, 2))  # (TP, PP) of the SGLang engines synced at once


def _engines(model: str) -> tuple[tuple[int, int], ...]:
    return tuple(e for e in ENGINES if e[1] == 1 or model not in _models.NO_PP)
TRAINERS = {"tp1": MegatronParallel(tp=1, dtype="float32"), "tp2": MegatronParallel(tp=2, dtype="float32"),
            "pp2": MegatronParallel(pp=2, dtype="float32"),
            "tp2ep2": MegatronParallel(tp=2, ep=2, etp=1, dtype="float32")}


def _trainers(spec) -> list[str]:
    """Every dense model from every dense trainer layout; Qwen3-MoE from TP 2 (tests/dist has
    the expert-parallel trainers); latent attention from TP 2 EP 2 (the issue's topology)."""
    if spec.find(Latent) is not None:
        return ["tp2ep2"]
    return ["tp2"] if spec.num_experts else ["tp1", "tp2", "pp2"]


COMBOS = [(m, t) for m, spec in _models.SPECS.items() for t in _trainers(spec)]
# (version, mode for update(), base version of a delta or None)
STEPS = ((1, None, None), (2, "broadcast", None), (3, None, 2))
SESSION = ["/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update"]  # one call, no pause
PER_UPDATE = ["/pause_generation", "/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
              "/update_weight_version", "/continue_generation"]


def _ctx():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_models.PRELOAD)  # every rank imports SGLang once, in the fork server
    return ctx


def start_servers(model: str, engines: tuple[tuple[int, int], ...] | None = None, **env) -> list[FakeSglang]:
    spec = _models.SPECS[model]
    source = version_source(spec, 0)
    initial = {n: source(n) for n in logical_tensors(spec)}
    return [FakeSglang(spec, tp, initial, pp=pp, env={"SHARDSYNC_TOKEN": TOKEN, **env}, ctx=_ctx())
            for tp, pp in engines or _engines(model)]


@pytest.fixture(scope="module")
def servers(request):
    started = start_servers(request.param)
    yield request.param, started
    for s in started:
        s.stop()


def _load(params, lay, rank, source) -> None:
    for k, v in load_rank(lay, rank, source).items():
        params[k].copy_(v)  # in place: the sync reads the parameters where they live


def _trainer(rank: int, world: int, port: int, model: str, trainer: str, urls: list[str], out) -> None:
    spec = _models.SPECS[model]
    par = TRAINERS[trainer]
    lay, params = join_trainer(rank, world, port, spec, par, seed=0)
    cfg = SyncConfig(delta=DeltaConfig(transport="p2p"), control=ControlConfig(channel="sglang", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.25, timeout_s=60))
    sync = WeightSync(spec, par, rank, params, urls, cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"connected": sync.mode.value, "fallback": sync.fallback_reason, "steps": []}
    for version, mode, base in STEPS:
        _load(params, lay, rank, version_source(spec, version, base))
        rec = sync.update(version, mode=mode)
        step = {"version": version, "mode": rec.mode, "ok": rec.ok, "engines": rec.engines_json(),
                "mismatched": sync.verify()}
        if rank == 0:
            step["sglang"] = [httpx.post(u + "/fake/compare", json={"version": version, "base": base},
                                         timeout=120).json()["mismatched"] for u in urls]
            step["weight_version"] = [httpx.get(u + "/model_info", timeout=10).json()["weight_version"] for u in urls]
        res["steps"].append(step)
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize(("servers", "trainer"), COMBOS, indirect=["servers"])
def test_sync_equals_sglang_own_loader_bit_for_bit(servers, trainer) -> None:
    model, started = servers
    _sync_and_check(model, trainer, started, [EngineParallel(tp=tp, pp=pp) for tp, pp in _engines(model)], checks=1)


@pytest.mark.parametrize(("model", "fused"), [("tiny-deepseek-v3", {"shared_fused"}),
                                             ("tiny-glm5", {"shared_fused", "indexer_fused"})])
def test_expert_parallel_and_fused_engines(model: str, fused: set[str]) -> None:
    """Latent and sparse attention into SGLang at TP 2 EP 2 and at TP 2 with what it fuses on CUDA
    (the shared expert; GLM-5's indexer key): the fused engine refuses the first plan naming its
    variant, the trainer plans again, p2p lands in place."""
    spec = _models.SPECS[model]
    initial = {n: version_source(spec, 0)(n) for n in logical_tensors(spec)}
    env = {"SHARDSYNC_TOKEN": TOKEN}
    variants = frozenset(fused)
    started = [FakeSglang(spec, 2, initial, ep=2, env=env, ctx=_ctx()),
               FakeSglang(spec, 2, initial, variants=variants, env=env, ctx=_ctx())]
    try:
        _sync_and_check(model, "tp2ep2", started, [EngineParallel(tp=2, ep=2), EngineParallel(tp=2, variants=variants)],
                        checks=2)
    finally:
        for s in started:
            s.stop()


def _updates(url: str) -> dict[str, float]:
    """``shardsync_updates_total{outcome="ok"}`` by path, read from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {s.labels["path"]: s.value for f in text_string_to_metric_families(text) if f.name == "shardsync_updates"
            for s in f.samples if s.name.endswith("_total") and s.labels.get("outcome") == "ok"}


def _sync_and_check(model: str, trainer: str, started: list[FakeSglang], engines: list[EngineParallel], *,
                    checks: int) -> None:
    """Every step lands bit for bit as SGLang's own load; ``checks``: connect checks before the join."""
    for s in started:
        s.events.clear()
    before = [_updates(s.url) for s in started]
    world = TRAINERS[trainer].world_size
    results = run_world(_trainer, world, args=(world, free_port(), model, trainer, [s.url for s in started]),
                        timeout=400)
    # SGLang's /metrics (every process's values, as under --enable-metrics): each update once per engine
    for s, was in zip(started, before, strict=True):
        now = _updates(s.url)
        assert {p: now.get(p, 0) - was.get(p, 0) for p in now} == {"p2p": 1, "broadcast": 1, "delta-p2p": 1}, now
    r0 = results[0]
    assert r0["connected"] == "p2p", r0["fallback"]
    assert [s["mode"] for s in r0["steps"]] == ["p2p", "broadcast", "delta-p2p"]
    spec = _models.SPECS[model]
    full = spec.num_parameters() * 4
    for s in r0["steps"]:
        assert s["ok"] and s["mismatched"] == [], (s["mode"], s["mismatched"][:5])
        assert s["sglang"] == [[[] for _ in range(e.world_size)] for e in engines], (s["mode"], s["sglang"])
        assert s["weight_version"] == [str(s["version"])] * len(engines)
        for got, e in zip(s["engines"], engines, strict=True):
            assert got["destination"] == "params"  # SGLang's parameters are shardsync's engine layout
            if s["mode"] == "p2p":  # every rank gets only its own bytes: what its layout holds, once
                held = 4 * sum(p.numel for r in engine_layout(spec, e).ranks
                               for p in r.pieces)  # replicated KV heads and MLA down projections included
                assert held <= got["bytes_received"] <= held * 1.01, (e, got["bytes_received"], held)
            if s["mode"] == "broadcast":
                assert got["bytes_received"] >= e.world_size * full
    for srv in started:  # O(1) SGLang calls per update, whatever the bucket count; paused -> continued
        posts = [p for p, _ in srv.events]
        assert posts == SESSION * (checks + 1) + (PER_UPDATE + SESSION) * len(STEPS) + SESSION, posts  # check(s),
        assert not srv.paused and srv.dead is None  # join; each update and its verify; leave
