"""``shardsync engine serve``: start TP worker processes; worker 0 also serves HTTP."""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.lora import Lora
from shardsync.lora.flags import lora_flags
from shardsync.placement import rank_device
from shardsync.store.auth import is_loopback
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.store.secret import ENV_TOKEN, load_secret
from shardsync.store.signed import SignedStore
from shardsync.transport.proof import prove
from shardsync.vocab import Crossing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    tp: int = 1
    ep: int = 1  # expert parallel within the TP group (mixture-of-experts models)
    host: str = "127.0.0.1"
    port: int = 8000  # 0 to ``spawn_server``: a free port it binds itself before the server starts
    seed: int = 0
    dtype: str | None = None
    device: str = "cpu"
    threads: int = 1
    request_wait_s: float = 60.0
    log_level: str = "warning"
    advertise: str | None = None  # test stand-in: "kind=vllm,pp=2,quantization=fp8" (engine facts)
    token_file: str | None = None  # the shared secret (else $SHARDSYNC_TOKEN / $SHARDSYNC_TOKEN_FILE)
    delta_root: str | None = None  # disk deltas are pulled only from under this directory
    staging_bytes: int = 0  # receive while serving into this much staging (0: in place; -1: one shard)
    crossing: Crossing = Crossing.FINISH  # running requests when the weights change: finish | span | abort
    commit_wait_s: float = 30.0  # finish: the longest a change waits for them
    quantization: str | None = None  # an FP8 format (quant.FORMATS): serve FP8 weights, quantize what arrives
    lora: Lora | None = None  # serve this adapter on the base: syncs then write the adapter alone
    lora_merge: bool = False  # ... merged into the base (no LoRA kernel): base + scale * B @ A served
    listen_fd: int | None = None  # serve on this listening socket (its launcher bound ``port``)

    def __post_init__(self) -> None:
        object.__setattr__(self, "crossing", Crossing.parse(self.crossing, "crossing"))




FACTS = {"kind": str, "pp": int, "quantization": str}


def parse_facts(text: str | None) -> dict:
    """``kind=vllm,pp=2`` -> {"kind": "vllm", "pp": 2} (only the engine facts a trainer reads)."""
    out: dict = {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key not in FACTS or not value:
            raise ValueError(f"--advertise takes {sorted(FACTS)} as key=value pairs, got {item!r}")
        out[key] = FACTS[key](value)
    return out


def engine_command(cfg: EngineConfig) -> list[str]:
    """``shardsync engine serve`` for ``cfg`` (the CLI front of ``serve``)."""
    cmd = [sys.executable, "-m", "shardsync.cli", "engine", "serve", "--model", cfg.model,
           "--tp", str(cfg.tp), "--ep", str(cfg.ep), "--host", cfg.host, "--port", str(cfg.port),
           "--seed", str(cfg.seed),
           "--device", cfg.device, "--threads", str(cfg.threads), "--log-level", cfg.log_level,
           "--staging-bytes", "shard" if cfg.staging_bytes == -1 else str(cfg.staging_bytes),
           "--crossing", cfg.crossing.value, "--commit-wait-s", str(cfg.commit_wait_s)]
    optional = {"--dtype": cfg.dtype, "--advertise": cfg.advertise, "--token-file": cfg.token_file,
                "--delta-root": cfg.delta_root, "--quantization": cfg.quantization,
                "--listen-fd": None if cfg.listen_fd is None else str(cfg.listen_fd)}
    cmd += lora_flags(cfg.lora, merge=cfg.lora_merge)
    return cmd + [a for flag, value in optional.items() if value for a in (flag, value)]


def spawn_server(cfg: EngineConfig, **popen: Any) -> tuple[subprocess.Popen, str]:
    """Start an engine server for ``cfg`` as a subprocess; (process, base URL), not yet healthy
    (``wait_healthy``).  ``popen``: extra ``subprocess.Popen`` arguments (stdout, preexec_fn).
    Port 0: this process binds a free port and hands the listening socket to the server, so no
    other process can take the port between choosing it and serving on it."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.threads))
    if cfg.port != 0:
        return subprocess.Popen(engine_command(cfg), env=env, **popen), f"http://{cfg.host}:{cfg.port}"
    with socket.create_server((cfg.host, 0)) as sock:  # listening; the server accepts on it
        cfg = replace(cfg, port=sock.getsockname()[1], listen_fd=sock.fileno())
        proc = subprocess.Popen(engine_command(cfg), env=env, pass_fds=(sock.fileno(),), **popen)
    return proc, f"http://{cfg.host}:{cfg.port}"


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launcher dies (no orphaned TP workers)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.debug("no PR_SET_PDEATHSIG here: workers outlive a killed launcher")


def _worker(rank: int, cfg: EngineConfig, token: str, tp_port: int, commands: list, results,
            events) -> None:
    from pathlib import Path

    from shardsync.engine.dispatch import Dispatcher, Serving, peer_loop
    from shardsync.engine.worker import EngineWorker
    from shardsync.models.engine import EngineModel
    from shardsync.models.weights import checkpoint_source, random_source
    from shardsync.presets import load_spec

    _die_with_parent()
    torch.set_num_threads(cfg.threads)
    logging.basicConfig(level=cfg.log_level.upper(), format=f"[engine tp{rank}] %(levelname)s %(name)s: %(message)s")
    group = None
    if cfg.tp > 1:  # the engine's own world is its TP group (the trainer never joins it)
        # its store on loopback only (torch's own would listen on every interface), its values
        # signed and its members proven, as a sync group's (another local user cannot stand in)
        store = open_store(Rendezvous("127.0.0.1", tp_port, cfg.tp, "engine-tp", timeout_s=600), is_master=rank == 0)
        signed = SignedStore(store, token)  # alive as long as this worker (the group calls into it)
        timeout = datetime.timedelta(seconds=600)
        dist.init_process_group("gloo", store=signed, rank=rank, world_size=cfg.tp, timeout=timeout)
        group = dist.group.WORLD
        prove(group, cfg.tp, rank, context=f"engine-tp/{tp_port}", secret=token, timeout=timeout, device=None,
              who=lambda r: f"engine TP worker {r}")
    spec = load_spec(cfg.model, dtype=cfg.dtype)
    source = (checkpoint_source(cfg.model) if Path(cfg.model).is_dir()
              else random_source(spec, cfg.seed))
    device = rank_device(cfg.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # NCCL sync groups use the current device
    model = EngineModel.from_source(spec, source, rank, cfg.tp, group, dtype=spec.dtype, device=device, ep=cfg.ep,
                                    quantization=cfg.quantization, lora=cfg.lora, lora_merge=cfg.lora_merge)
    worker = EngineWorker(model, rank, cfg.tp, secret=token, staging_bytes=cfg.staging_bytes)
    if rank != 0:
        peer_loop(worker, commands[rank - 1], results, events)
        return
    import uvicorn

    from shardsync.control.session import UpdateSession
    from shardsync.engine.server import create_app

    dispatcher = Dispatcher(worker, commands, results, UpdateSession(), events=events,
                            serving=Serving(cfg.crossing, cfg.commit_wait_s))
    dispatcher.start()
    app = create_app(dispatcher, request_wait_s=cfg.request_wait_s, facts=parse_facts(cfg.advertise),
                     token=token, delta_root=cfg.delta_root)
    # keep-alive clients must not hold a stop open: in-flight requests get a few seconds
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                           timeout_graceful_shutdown=5))
    try:  # a stop is SIGINT, which uvicorn re-raises once it has shut down (``uvicorn.run`` swallows it too)
        server.run(sockets=None if cfg.listen_fd is None else [socket.socket(fileno=cfg.listen_fd)])
    except KeyboardInterrupt:
        pass
    dispatcher.stop()


def serve(cfg: EngineConfig) -> int:
    """Run the engine until interrupted or until any TP worker dies (then every worker is
    stopped: an engine missing a worker cannot serve consistently); returns the exit code."""
    secret = load_secret(token_file=cfg.token_file)
    if not secret.given and not is_loopback(cfg.host):
        log.error("refusing to serve on %s with this user's own secret: a trainer on another machine cannot "
                  "read it; set $%s (or --token-file) on the engine and the trainer", cfg.host, ENV_TOKEN)
        return 2
    # printed whatever the log level (Jupyter's habit): where a caller finds what it must present
    print(f"shardsync engine: control calls need the secret from {secret.origin}", file=sys.stderr, flush=True)
    token = secret.value
    # fork: this process imported torch and started no thread and no CUDA yet, so each worker
    # starts with torch loaded instead of importing it again (seconds of CPU per worker)
    ctx = mp.get_context("fork")
    commands = [ctx.Queue() for _ in range(cfg.tp - 1)]
    results, events = ctx.Queue(), ctx.Queue()
    tp_port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, cfg, token, tp_port, commands, results, events), daemon=False)
             for r in range(cfg.tp)]
    for p in procs:
        p.start()
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True
        pid = procs[0].pid
        if procs[0].is_alive() and pid is not None:
            os.kill(pid, signal.SIGINT)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(p.exitcode is None for p in procs):
        mp_connection.wait([p.sentinel for p in procs], timeout=1.0)
    dead = next(r for r, p in enumerate(procs) if p.exitcode is not None)
    code = procs[dead].exitcode or 0
    if not (stopping and dead == 0):
        log.error("engine TP worker %d exited (code %s): stopping every worker", dead, procs[dead].exitcode)
        code = code or 1
    grace = 10.0 if stopping else 1.0  # a broken engine is not drained: it stops now
    stop()
    for q in commands:
        q.put(None)
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)
    return code
