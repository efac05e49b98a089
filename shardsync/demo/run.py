"""Launch engine server(s) and trainer ranks as separate processes and run GRPO steps.

Per step: rollouts from the engines (tokens + logprobs + weight version), trainer
logprobs, GRPO loss, optimizer step, then a weight update per mode with a bitwise check.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.demo import report, task
from shardsync.transport.group import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    model: str = "tiny-qwen3"
    trainer_tp: int = 2
    trainer_pp: int = 1
    engine_tp: tuple[int, ...] = (2,)
    steps: int = 5
    mode: str = "both"
    bucket_mb: float = 1.0
    prompts: int = 4
    group: int = 4
    prompt_len: int = 8
    max_new_tokens: int = 8
    lr: float | None = None  # None: 1e-2 (reward visibly rises), 1e-5 for delta (RL-typical, sparse)
    seed: int = 0
    out: str = "out/demo"
    timeout_s: float = 120.0
    delta_transport: str = "p2p"
    verify: bool = True  # bitwise checksum after every update (SHARDSYNC_SKIP_VERIFY=1 skips it)
    engine_dtype: str | None = None  # None: the model's; delta defaults to bfloat16

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-5 if self.mode == "delta" else 1e-2

    @property
    def modes(self) -> list[str]:
        return ["p2p", "broadcast"] if self.mode == "both" else [self.mode]




def start_engines(cfg: DemoConfig) -> list[tuple[subprocess.Popen, str]]:
    engines = []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for tp in cfg.engine_tp:
        port = free_port()
        cmd = [sys.executable, "-m", "shardsync.cli", "engine", "serve", "--model", cfg.model,
               "--tp", str(tp), "--port", str(port), "--seed", str(cfg.seed)]
        dtype = cfg.engine_dtype or ("bfloat16" if cfg.mode == "delta" else None)
        if dtype:
            cmd += ["--dtype", dtype]
        engines.append((subprocess.Popen(cmd, env=env), f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + cfg.timeout_s
    for proc, url in engines:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"engine {url} exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine {url} not healthy after {cfg.timeout_s}s")
            time.sleep(0.3)
    return engines


def _rollouts(cfg: DemoConfig, urls: list[str], step: int, vocab: int, version: int) -> dict:
    """Rank 0: prompts spread over engines, ``group`` samples each; the batch for training."""
    prompts = task.make_prompts(step, cfg.prompts, cfg.prompt_len, vocab, cfg.seed)
    per_engine: list[list[list[int]]] = [[] for _ in urls]
    for i, p in enumerate(prompts):
        per_engine[i % len(urls)].extend([p] * cfg.group)
    seqs, lps, rewards = [], [], []
    for url, batch in zip(urls, per_engine, strict=True):
        if not batch:
            continue
        r = httpx.post(url + "/generate", timeout=cfg.timeout_s, json={
            "prompts": batch, "max_new_tokens": cfg.max_new_tokens, "temperature": 1.0,
            "seed": cfg.seed * 7919 + step}).json()
        if r["weight_version"] != version:
            raise RuntimeError(f"{url} answered with weight version {r['weight_version']}, expected {version}")
        for p, out in zip(batch, r["outputs"], strict=True):
            seqs.append(p + out["tokens"])
            lps.append(out["logprobs"])
            rewards.append(task.reward(out["tokens"], vocab))
    return {"ids": seqs, "engine_logprobs": lps, "rewards": rewards}


def _engine_logprobs(url: str, seqs: list[list[int]], cfg: DemoConfig) -> torch.Tensor:
    r = httpx.post(url + "/logprobs", json={"sequences": seqs}, timeout=cfg.timeout_s)
    r.raise_for_status()
    return torch.tensor(r.json()["logprobs"])


def _trainer(rank: int, cfg: DemoConfig, port: int, urls: list[str], results) -> None:
    from shardsync.layout import MegatronParallel
    from shardsync.models.trainer import OptimConfig, TrainerModel, grpo_loss, megatron_groups
    from shardsync.models.weights import checkpoint_source, random_source
    from shardsync.spec import load_spec
    from shardsync.sync import SyncConfig, WeightSync

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[trainer {rank}] %(name)s: %(message)s")
    par = MegatronParallel(tp=cfg.trainer_tp, pp=cfg.trainer_pp, dtype="float32")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=par.world_size, timeout=datetime.timedelta(seconds=cfg.timeout_s))
    spec = load_spec(cfg.model)
    groups = megatron_groups(par, timeout_s=cfg.timeout_s)
    model = TrainerModel(spec, par, rank, groups.tp, groups.pp, dp_group=groups.dp,
                         source=checkpoint_source(cfg.model) if Path(cfg.model).is_dir() else random_source(spec, cfg.seed),
                         optim=OptimConfig(lr=cfg.learning_rate))
    out = Path(cfg.out)
    sync = WeightSync(spec, par, rank, dict(model.named_parameters()), urls,
                      SyncConfig(mode="auto" if cfg.mode == "both" else cfg.mode, bucket_mb=cfg.bucket_mb,
                                 timeout_s=cfg.timeout_s, records_path=str(out / "records.jsonl") if rank == 0 else None,
                                 delta_transport=cfg.delta_transport, delta_dir=str(out / "versions")),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    if cfg.mode == "both":
        modes = [m for m in cfg.modes if m in sync.modes]
    else:
        modes = ["delta"] if cfg.mode == "delta" else [sync.mode]
    version = 0
    for step in range(1, cfg.steps + 1):
        box = [_rollouts(cfg, urls, step, spec.vocab_size, version) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        batch = box[0]
        ids = torch.tensor(batch["ids"], dtype=torch.long)
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        mask[:, cfg.prompt_len - 1:] = 1.0
        old = model.policy_logprobs(ids)
        engine_lp = torch.tensor(batch["engine_logprobs"])
        lp_diff = float((old[:, cfg.prompt_len - 1:] - engine_lp).abs().mean())
        rewards = torch.tensor(batch["rewards"])
        adv = task.group_advantages(rewards, cfg.group)
        stats = model.train_step(ids, functools.partial(grpo_loss, old_logprobs=old, advantages=adv, mask=mask))
        version += 1
        new = model.policy_logprobs(ids)[:, cfg.prompt_len - 1:]  # the weights being synced
        updates = {}
        for mode in modes:
            rec = sync.update(version, mode=None if mode == "delta" else mode)
            bad = sync.verify() if cfg.verify else None
            # train/rollout agreement right after this path's update: engine scores the batch
            scored = _engine_logprobs(urls[0], batch["ids"], cfg) if rank == 0 else None
            updates[mode] = {"phases": rec.phases, "busiest_link_bytes": rec.busiest_link_bytes,
                             "bytes": sum(rec.link_bytes.values()), "buckets": rec.buckets,
                             "checksum_ok": None if bad is None else not bad, "mismatch": (bad or [])[:5],
                             "fallback": rec.fallback_reason,
                             "path": rec.mode, "delta": rec.delta,
                             "logprob_abs_diff": None if scored is None else
                             float((new - scored[:, cfg.prompt_len - 1:]).abs().mean())}
        row = {"step": step, "reward": float(rewards.mean()), "loss": stats.loss,
               "grad_norm": stats.grad_norm, "logprob_abs_diff": lp_diff, "version": version,
               "updates": updates}
        if rank == 0:
            results.put(("row", row, modes))
    sync.close()
    dist.destroy_process_group()
    if rank == 0:
        results.put(("done", None, modes))


def run_demo(cfg: DemoConfig) -> int:
    """Parent process: engines as subprocesses, trainer ranks as spawned processes."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").unlink(missing_ok=True)
    engines = start_engines(cfg)
    urls = [u for _, u in engines]
    world = cfg.trainer_tp * cfg.trainer_pp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_trainer, args=(r, cfg, port, urls, results)) for r in range(world)]
    rows: list[dict] = []
    code = 0
    try:
        for p in procs:
            p.start()
        print(f"shardsync demo: {cfg.model}, trainer TP{cfg.trainer_tp} PP{cfg.trainer_pp} -> "
              f"engines TP {list(cfg.engine_tp)}, {cfg.steps} GRPO steps, modes {cfg.modes}")
        modes: list[str] = cfg.modes
        printed = False
        deadline = time.monotonic() + cfg.timeout_s * (cfg.steps + 2)
        while True:
            try:
                kind, row, modes = results.get(timeout=5)
            except Exception:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError("a trainer rank failed; see its output above") from None
                if time.monotonic() > deadline:
                    raise TimeoutError("demo did not finish in time") from None
                continue
            if kind == "done":
                break
            if not printed:
                print(report.header(modes))
                printed = True
            print(report.row(row, modes), flush=True)
            rows.append(row)
        for line in report.summary(rows, modes):
            print(line)
        (out / "steps.json").write_text(json.dumps({"config": asdict(cfg), "steps": rows}, indent=2))
        report.plot(rows, modes, out / "demo.png")
        print(f"wrote {out / 'records.jsonl'}, {out / 'steps.json'}, {out / 'demo.png'}")
        if any(u["checksum_ok"] is False for r in rows for u in r["updates"].values()):
            code = 1
    except Exception as e:
        print(f"demo failed: {e}", file=sys.stderr)
        code = 1
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        for proc, _ in engines:
            proc.terminate()
        for proc, _ in engines:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return code
