"""Launch engine server(s) and trainer ranks as separate processes and run GRPO steps.

Per step: rollouts from the engines (tokens + logprobs + weight version), trainer
logprobs, GRPO loss, optimizer step, then a weight update per mode with a bitwise check.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from shardsync.control.client import wait_healthy
from shardsync.demo import report
from shardsync.dtypes import torch_dtype
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.layout import Fsdp2Parallel, MegatronParallel
from shardsync.lora import Lora
from shardsync.store.rendezvous import free_port
from shardsync.timeline import render as draw_timeline

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    model: str = "tiny-qwen3"
    trainer_tp: int = 2
    trainer_pp: int = 1
    trainer_dp: int = 1
    trainer_ep: int = 1  # mixture-of-experts models: expert parallel ...
    trainer_etp: int | None = None  # ... and expert tensor parallel (None: trainer_tp)
    trainer_pp_layers: tuple[int, ...] | None = None  # uneven pipeline stages
    engine_tp: tuple[int, ...] = (2,)
    engine_ep: int = 1
    trainer_kind: str = "megatron"  # or "fsdp2": trainer_dp ranks fully_shard a transformers model
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
    device: str = "cpu"  # "cuda": trainer ranks and engines on the GPU(s), sharing them
    ipc: bool | None = None  # engines read the trainer's tensors in place; None: on with cuda
    engine: str = "reference"  # or "vllm": real vLLM servers (docs/vllm.md)
    staging: bool = True  # reference engines receive while serving (one shard of staging each)
    engine_quantization: str | None = None  # reference engines serve FP8 in this format (quant.FORMATS)
    lora_rank: int = 0  # train a LoRA adapter of this rank (alpha 2R, every linear) and sync it alone

    def __post_init__(self) -> None:
        if self.engine not in ("reference", "vllm"):
            raise ValueError(f"engine must be reference or vllm, got {self.engine!r}")
        if self.trainer_kind not in ("megatron", "fsdp2"):
            raise ValueError(f"trainer must be megatron or fsdp2, got {self.trainer_kind!r}")
        if self.trainer_kind == "fsdp2" and (self.device != "cpu" or self.trainer_tp > 1 or self.trainer_pp > 1):
            raise ValueError("--trainer fsdp2 runs on CPU with --trainer-dp ranks only (no --trainer-tp/--trainer-pp)")
        if self.engine_quantization is not None and self.engine != "reference":
            raise ValueError("--engine-quantization runs reference engines (the real engines' hosts refuse "
                             "quantized models so far)")
        if self.lora_rank and self.engine != "reference":
            raise ValueError("--lora runs reference engines in the demo (adapter syncs into vLLM and SGLang: "
                             "docs/lora.md)")
        if self.engine == "vllm" and (self.device != "cpu" or self.ipc):
            raise ValueError("--engine vllm runs vLLM's CPU build here: no --device cuda or --ipc")

    @property
    def trainer(self) -> MegatronParallel | Fsdp2Parallel:
        if self.trainer_kind == "fsdp2":
            return Fsdp2Parallel(shard=self.trainer_dp, dtype="float32")
        return MegatronParallel(tp=self.trainer_tp, pp=self.trainer_pp, dp=self.trainer_dp, ep=self.trainer_ep,
                                etp=self.trainer_etp, pp_layers=self.trainer_pp_layers, dtype="float32")

    @property
    def lora(self) -> Lora | None:
        return Lora(self.lora_rank, 2.0 * self.lora_rank) if self.lora_rank else None

    @property
    def uses_ipc(self) -> bool:
        return self.device != "cpu" if self.ipc is None else self.ipc

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 1e-5 if self.mode == "delta" else 1e-2

    @property
    def modes(self) -> list[str]:
        return ["p2p", "broadcast"] if self.mode == "both" else [self.mode]

    def engine_config(self, tp: int, **overrides) -> EngineConfig:
        """One engine server of this demo (delta runs bf16 engines unless told otherwise)."""
        dtype = self.engine_dtype or ("bfloat16" if self.mode == "delta" else None)
        fields = {"delta_root": str(Path(self.out).resolve() / "versions"),
                  "staging_bytes": -1 if self.staging else 0, "quantization": self.engine_quantization,
                  "lora": self.lora, **overrides}
        return EngineConfig(model=self.model, tp=tp, ep=self.engine_ep, seed=self.seed, dtype=dtype,
                            device=self.device, **fields)




def start_engines(cfg: DemoConfig) -> list[tuple[subprocess.Popen, str]]:
    if cfg.engine == "vllm":
        return _start_vllm(cfg)
    engines = [spawn_server(cfg.engine_config(tp, port=0)) for tp in cfg.engine_tp]
    deadline = time.monotonic() + cfg.timeout_s
    for proc, url in engines:
        wait_healthy(url, proc, max(0.0, deadline - time.monotonic()))
    return engines


def _start_vllm(cfg: DemoConfig) -> list[tuple[subprocess.Popen, str]]:
    """vLLM servers started from a checkpoint of the trainer's initial weights."""
    from shardsync.engines.vllm import serve
    from shardsync.launch.loop import initial_weights
    from shardsync.models.checkpoint import write_checkpoint

    out = Path(cfg.out).resolve()
    spec, source = initial_weights(cfg)
    dtype = cfg.engine_dtype or ("bfloat16" if cfg.mode == "delta" else spec.dtype)
    ckpt = str(write_checkpoint(spec, source, out / "checkpoint", dtype=torch_dtype(dtype)))
    engines = []
    try:
        for i, tp in enumerate(cfg.engine_tp):  # one at a time: two starting together crowd 2 cores
            engines.append(serve.start(serve.VllmServer(ckpt, tp=tp, dtype=dtype), log_path=str(out / f"vllm{i}.log"),
                                       timeout_s=max(cfg.timeout_s, 300)))
    except Exception:
        for proc, _ in engines:
            serve.stop(proc)
        raise
    return engines


def _trainer(rank: int, cfg: DemoConfig, port: int, urls: list[str], results) -> None:
    """One spawned trainer rank: the shared per-rank loop; rank 0 streams the rows."""
    from shardsync.launch.loop import RankSite, trainer_rank

    logging.basicConfig(level=logging.WARNING, format=f"[trainer {rank}] %(name)s: %(message)s")
    out = Path(cfg.out)
    site = RankSite(rank=rank, init_method=f"tcp://127.0.0.1:{port}", sync_host="127.0.0.1",
                    engines=tuple(urls), delta_dir=str(out / "versions"),
                    records_path=str(out / "records-{rank}.jsonl"), detail=True)
    modes: tuple[str, ...] = tuple(cfg.modes)
    for result in trainer_rank(cfg, site, verify=cfg.verify):
        modes = result.modes
        if rank == 0:
            results.put(("row", result.row, list(modes)))
    if rank == 0:
        results.put(("done", None, list(modes)))


def _stop(cfg: DemoConfig, engines: list[tuple[subprocess.Popen, str]]) -> None:
    if cfg.engine == "vllm":
        from shardsync.engines.vllm import serve

        for proc, _ in engines:
            serve.stop(proc)
        return
    for proc, _ in engines:
        proc.terminate()
    for proc, _ in engines:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_demo(cfg: DemoConfig) -> int:
    """Parent process: engines as subprocesses, trainer ranks as spawned processes."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in (out / "records.jsonl", *out.glob("records-*.jsonl")):
        old.unlink(missing_ok=True)
    engines = start_engines(cfg)
    urls = [u for _, u in engines]
    world = cfg.trainer.world_size
    from shardsync.launch.procs import worker_context

    ctx = worker_context()
    results = ctx.Queue()
    port = free_port()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    procs = [ctx.Process(target=_trainer, args=(r, cfg, port, urls, results)) for r in range(world)]
    rows: list[dict] = []
    code = 0
    try:
        for p in procs:
            p.start()
        t = cfg.trainer
        if isinstance(t, Fsdp2Parallel):
            desc = f"FSDP2 shard {t.shard}"
        else:
            experts = f" EP{t.ep} ETP{t.expert_tp}" if cfg.trainer_ep > 1 or cfg.trainer_etp else ""
            desc = f"TP{t.tp} PP{t.pp} DP{t.dp}{experts}"
        print(f"shardsync demo: {cfg.model}, trainer {desc} -> "
              f"{'vLLM' if cfg.engine == 'vllm' else 'engines'} TP {list(cfg.engine_tp)}"
              f"{f' EP{cfg.engine_ep}' if cfg.engine_ep > 1 else ''}"
              f"{f' serving {cfg.engine_quantization}' if cfg.engine_quantization else ''}"
              f"{f', a LoRA adapter of rank {cfg.lora_rank} synced alone' if cfg.lora_rank else ''}, "
              f"{cfg.steps} GRPO steps, modes {cfg.modes}")
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
        (out / "records.jsonl").symlink_to("records-0.jsonl")  # rank 0's, where it always was
        drawn = f", {out / 'timeline.png'} and {out / 'timeline.json'} (the last full update, per bucket)"
        try:
            draw_timeline(sorted(out.glob("records-*.jsonl")), png=out / "timeline.png", trace=out / "timeline.json")
        except ValueError as e:  # only delta updates (no bucket times): nothing to draw
            drawn = f" (no timeline: {e})"
        print(f"wrote {out / 'records.jsonl'} (every rank's: records-<rank>.jsonl), {out / 'steps.json'}, "
              f"{out / 'demo.png'}{drawn}")
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
        _stop(cfg, engines)
    return code
