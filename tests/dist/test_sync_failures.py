"""Failures end to end: fallback from p2p with the reason logged, and a trainer rank that
dies mid-update (the engine goes stale, refuses to serve, and recovers on a full update)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import time

import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.launch.procs import children
from shardsync.layout import MegatronParallel
from shardsync.lora import Lora, adapter_tensors
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS, load_spec
from shardsync.config import SyncConfig, TransportConfig
from shardsync.control.wire import Go
from shardsync.store.keys import Keys
from shardsync.store.sealed import get
from shardsync.store.secret import load_secret
from shardsync.paths import choose_full
from shardsync.sync import SyncError, WeightSync
from shardsync.topology import Topology
from shardsync.views import views_of
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _trainer(rank: int, world: int, port: int, url: str, case: dict, out) -> None:
    torch.set_num_threads(1)
    handler = _Lines()
    logging.getLogger("shardsync").addHandler(handler)
    logging.getLogger("shardsync").setLevel(logging.INFO)
    spec = load_spec(case["model"])
    par = MegatronParallel(tp=world, dtype="float32")
    _, params = join_trainer(rank, world, port, spec, par, seed=case["seed"])
    lora = case.get("lora")
    if lora is not None:  # the trainer syncs an adapter alone
        params = load_rank(Topology(spec, par, views=views_of(None, lora)).trainer_layout, rank,
                           random_source(spec, case["seed"], shapes=adapter_tensors(spec, lora)))
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(transport=TransportConfig(bucket_mb=0.05, timeout_s=case.get("timeout", 30)),
                                 lora=lora, **case["config"]),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res: dict = {"mode": sync.mode, "reason": sync.fallback_reason}
    if case.get("die") and rank == 1:
        out.put((rank, res))
        # wait until trainer rank 0 began update 1 on the engines, then vanish
        get(sync.group.store, Keys(sync.group.rdv.name).go(1), Go, datetime.timedelta(seconds=30),
            load_secret().value)  # the sync's: this user's own
        os._exit(1)
    try:
        rec = sync.update(1)
        res["ok"] = rec.ok
        res["verify"] = sync.verify()
    except SyncError as e:
        res["error"] = str(e)
    res["log"] = handler.lines
    out.put((rank, res))
    if not case.get("die"):
        sync.close()
        dist.destroy_process_group()


# What the engine reports at connect (``--advertise``: the reference engine stands in for
# engines that cannot run here) -> the precondition that sends auto to broadcast.
FALLBACKS = {
    "engine_layout_known": ("tiny-qwen3", "kind=trtllm"),
    "vllm_vocab_split": ("tp3", "kind=vllm"),
    "quantization": ("tiny-qwen3", "quantization=fp8-per-tensor"),  # SGLang's online FP8: the loader quantizes
    "engine_pp_1": ("tiny-qwen3", "pp=2"),
}


@pytest.mark.parametrize("precondition", list(FALLBACKS))
def test_auto_falls_back_to_broadcast_and_logs_why(precondition: str, tmp_path) -> None:
    model, facts = FALLBACKS[precondition]
    trainer_tp, engine_tp = 2, 2
    if model == "tp3":
        # vLLM pads the vocab to 64 only: 1000 -> 1024 rows do not split over TP 3
        # (SGLang pads to 64*3 instead, so the engine layout itself exists).
        spec = PRESETS["tiny-qwen3"].replace(num_heads=6, num_kv_heads=3, intermediate_size=384,
                                             vocab_size=1000)
        (tmp_path / "config.json").write_text(json.dumps(spec.to_hf_config()))
        model, trainer_tp, engine_tp = str(tmp_path / "config.json"), 1, 3
    proc, url = start_engine(model, engine_tp, advertise=facts)
    try:
        case = {"model": model, "seed": 5, "config": {"mode": "auto"}}
        res = run_world(_trainer, trainer_tp, args=(trainer_tp, free_port(), url, case), timeout=180)
        assert res[0]["mode"] == "broadcast" and res[0]["ok"] and res[0]["verify"] == []
        fallback = [line for line in res[0]["log"] if "falls back to broadcast" in line]
        assert len(fallback) == 1 and precondition in fallback[0], res[0]["log"]
        assert not any("falls back" in line for r in res if r for line in res[r]["log"]), "only rank 0 logs"
        update_lines = [line for line in res[0]["log"] if "weight update v1 " in line]
        assert len(update_lines) == 1 and "fallback" in update_lines[0]
    finally:
        stop_engine(proc)


def test_forced_p2p_refuses_with_reason() -> None:
    topo = Topology(PRESETS["tiny-qwen3"], MegatronParallel(tp=1), views=views_of("fp8-per-tensor"))
    with pytest.raises(ValueError, match="quantization"):
        choose_full(topo, "p2p")
    assert choose_full(topo, "broadcast") == ("broadcast", None)


def _a_new_trainer_updates(url: str, lora: Lora | None = None) -> None:
    """A new trainer connects and sends a full update (of ``lora``): the engine serves version 1."""
    case = {"model": "tiny-qwen3", "seed": 6, "config": {"mode": "p2p"}, "lora": lora}
    res = run_world(_trainer, 2, args=(2, free_port(), url, case), timeout=180)
    assert res[0]["ok"] and res[0]["verify"] == []
    r = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["weight_version"] == 1


def test_trainer_rank_killed_mid_update_leaves_engine_stale_until_full_update() -> None:
    proc, url = start_engine("tiny-qwen3", 2)
    try:
        case = {"model": "tiny-qwen3", "seed": 5, "die": True, "timeout": 5, "config": {"mode": "p2p"}}
        res = run_world(_trainer, 2, args=(2, free_port(), url, case), timeout=180)
        assert "error" in res[0], res[0]
        health = httpx.get(url + "/health", timeout=30).json()
        assert health["stale"] and health["weight_version"] == 0
        r = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "stale" in r.json()["error"]
        _a_new_trainer_updates(url)  # the engine serves again
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("lora", [None, Lora(8, 16.0)], ids=["model", "adapter"])
def test_trainer_rank_killed_mid_staged_update_leaves_engine_serving_its_version(lora: Lora | None) -> None:
    """Staged (``--staging-bytes shard``): the cut receive wrote only staging, so the engine
    keeps serving version 0 bit for bit, not stale; the next trainer's update lands.
    ``adapter``: an engine serving a LoRA adapter keeps its adapter (PEFT's zero start)."""
    proc, url = start_engine("tiny-qwen3", 2, staging_bytes=-1, lora=lora)
    try:
        before = httpx.get(url + "/weights/checksum", timeout=30).json()
        case = {"model": "tiny-qwen3", "seed": 5, "die": True, "timeout": 5, "config": {"mode": "p2p"}, "lora": lora}
        res = run_world(_trainer, 2, args=(2, free_port(), url, case), timeout=180)
        assert "error" in res[0], res[0]
        health = httpx.get(url + "/health", timeout=30).json()
        assert not health["stale"] and health["weight_version"] == 0 and health["status"] == "ok"
        assert httpx.get(url + "/weights/checksum", timeout=30).json() == before, "served weights untouched"
        r = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.json()["weight_version"] == 0
        _a_new_trainer_updates(url, lora)  # the engine serves again
        assert httpx.get(url + "/weights/checksum", timeout=30).json() != before
    finally:
        stop_engine(proc)


class _KillsEngineOnSend:
    """Fault injector: on trainer rank 0's first data send the whole engine (launcher and TP
    workers) is SIGKILLed, i.e. an engine lost mid-update; the moment is kept."""

    def __init__(self, inner, pids: list[int], killed: list[float]) -> None:
        self.inner, self.pids, self.killed = inner, pids, killed

    def send(self, buf, peer):
        if not self.killed and buf.dtype != torch.int64:
            for pid in self.pids:
                os.kill(pid, signal.SIGKILL)
            self.killed.append(time.monotonic())
        return self.inner.send(buf, peer)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _trainer_kills_engine(rank: int, world: int, port: int, url: str, pids: list[int], out) -> None:
    spec = load_spec("tiny-qwen3")
    par = MegatronParallel(tp=world, dtype="float32")
    _, params = join_trainer(rank, world, port, spec, par, seed=5)
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(mode="p2p", transport=TransportConfig(bucket_mb=0.05, timeout_s=20)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    killed: list[float] = []
    if rank == 0:
        program = sync.programs[Mode.P2P]
        program.transport = _KillsEngineOnSend(program.transport, pids, killed)
    try:
        sync.update(1)
        res: dict = {"ok": True}
    except SyncError as e:
        res = {"error": str(e), "after_kill_s": time.monotonic() - killed[0] if killed else None}
    out.put((rank, res))
    dist.destroy_process_group()


def test_engine_killed_mid_update_is_named_within_seconds() -> None:
    """The engine dies under the trainer's first bucket: the trainer's update fails within 3 s
    (not the 20 s timeout) and its error names the engine (its heartbeat stopped)."""
    proc, url = start_engine("tiny-qwen3", 2)
    try:
        pids = [proc.pid, *children(proc.pid)]
        res = run_world(_trainer_kills_engine, 2, args=(2, free_port(), url, pids), timeout=120)
        assert "error" in res[0] and "error" in res[1], res
        assert url in res[0]["error"] and url in res[1]["error"], res
        assert res[0]["after_kill_s"] < 3.0, res[0]
    finally:
        proc.kill()
        proc.wait(10)
