"""Weight updates into one real vLLM server, side by side in one run, the same weights:

(a) ``full-reload``: vLLM's own full-tensor path, what a user does today without shardsync:
    trainer rank 0 holds full HF tensors, writes them as a checkpoint and vLLM reloads it
    (``/collective_rpc reload_weights`` between ``/pause`` and ``/resume``);
(b) shardsync ``broadcast``; (c) shardsync ``p2p``; (d) shardsync ``delta-p2p`` at ~1 %.

    python benchmarks/vllm_update.py --model Qwen2.5-0.5B --engine-tp 1 --rounds 3

Runs inside the vLLM virtualenv (``bash scripts/setup_vllm.sh``).  Rounds interleave the
paths; prints the median update time, bytes received per vLLM worker and trainer extra
memory per path, and writes JSON (``--out``).  (a) starts from full tensors already on rank
0: the gather that produces them in a real trainer is not counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

PATHS = ("full-reload", "broadcast", "p2p", "delta-p2p")


def _full_reload(url: str, spec, source, root: Path, timeout_s: float) -> tuple[float, int]:
    """(seconds, bytes written) of vLLM's own path for one version."""
    import httpx

    from shardsync.models.checkpoint import write_checkpoint

    t0 = time.perf_counter()
    ckpt = write_checkpoint(spec, source, root, dtype=getattr(torch, spec.dtype))
    httpx.post(url + "/pause?mode=wait", timeout=timeout_s).raise_for_status()
    r = httpx.post(url + "/collective_rpc", timeout=timeout_s,
                   json={"method": "reload_weights", "kwargs": {"weights_path": str(ckpt)}})
    r.raise_for_status()
    httpx.post(url + "/resume", timeout=timeout_s).raise_for_status()
    return time.perf_counter() - t0, (ckpt / "model.safetensors").stat().st_size


def _rank(rank: int, world: int, port: int, url: str, tp: int, args, out) -> None:
    import torch.distributed as dist

    from shardsync.config import ControlConfig, DeltaConfig, SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.models.weights import load_rank, random_source, sparse_change
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    spec = load_spec(args.model, dtype="float32")
    par = MegatronParallel(tp=world, dtype="float32")
    lay = Topology(spec, par).trainer_layout
    params = load_rank(lay, rank, random_source(spec, 0))
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(delta=DeltaConfig(transport="p2p"), control=ControlConfig(channel="vllm"),
                                 transport=TransportConfig(bucket_mb=args.bucket_mb, timeout_s=args.timeout)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    rows, version, root = [], 0, Path(args.workdir)

    def load(source) -> None:
        for k, v in load_rank(lay, rank, source).items():
            params[k].copy_(v)

    for rnd in range(args.rounds):
        for path in PATHS:
            version += 1
            source = random_source(spec, version)
            if path == "delta-p2p":  # a delta is against what vLLM holds: sync a full version first
                load(source)
                sync.update(version, mode="p2p")
                version += 1
                source = sparse_change(source, version)
            load(source)
            dist.barrier()
            if path == "full-reload":
                if rank == 0:
                    secs, written = _full_reload(url, spec, source, root / f"v{version}", args.timeout)
                    rows.append({"round": rnd, "path": path, "total_s": secs, "bytes_per_worker": written,
                                 "trainer_extra_bytes": written, "ok": True, "receive_s": None, "load_s": None})
                dist.barrier()
                continue
            rec = sync.update(version, mode=None if path == "delta-p2p" else path)
            if rank == 0:
                (e,) = rec.engines
                # a delta keeps a snapshot of this rank's shard (the last synced values)
                snapshot = sum(t.numel() * 4 for t in params.values()) if rec.mode.startswith("delta") else 0
                rows.append({"round": rnd, "path": rec.mode, "total_s": rec.total_s,
                             "bytes_per_worker": e.bytes_received // tp,
                             "trainer_extra_bytes": rec.buffer_bytes + snapshot, "ok": rec.ok,
                             "destination": e.destination,
                             "receive_s": e.transfer_s + e.unpack_s,
                             "load_s": e.total_s - e.transfer_s - e.unpack_s})
    sync.close()
    dist.destroy_process_group()
    if rank == 0:
        out.put(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen2.5-0.5B")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--engine-tp", default="1", help="vLLM TP, or a comma list (one server after another)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", default="docs/results/vllm_update_cpu.json")
    args = ap.parse_args()

    from shardsync.presets import load_spec

    spec = load_spec(args.model, dtype="float32")
    tps = [int(t) for t in str(args.engine_tp).split(",")]
    print(f"{args.model} float32 ({spec.num_parameters() * 4 / 2**20:.0f} MiB), trainer TP{args.trainer_tp}, "
          f"{args.rounds} rounds")
    result = {"command": "python benchmarks/vllm_update.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("workdir", "out")),
        "machine": f"{platform.node()} {os.cpu_count()} cores, torch {torch.__version__}",
        "model": args.model, "trainer_tp": args.trainer_tp, "engines": {}}
    for tp in tps:
        result["engines"][f"tp{tp}"] = _one_engine(spec, tp, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _one_engine(spec, tp: int, args) -> dict:
    from shardsync.engines.vllm import serve
    from shardsync.models.checkpoint import write_checkpoint
    from shardsync.models.weights import random_source
    from shardsync.store.rendezvous import free_port

    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as work:
        args.workdir = work
        ckpt = write_checkpoint(spec, random_source(spec, 0), Path(work) / "start")
        t0 = time.perf_counter()
        proc, url = serve.start(serve.VllmServer(str(ckpt), tp=tp), log_path=str(Path(work) / "vllm.log"),
                                timeout_s=900)
        start_s = time.perf_counter() - t0
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=_rank, args=(r, args.trainer_tp, port, url, tp, args, q))
                     for r in range(args.trainer_tp)]
            for p in procs:
                p.start()
            rows = q.get(timeout=args.timeout * 4)
            for p in procs:
                p.join(60)
        finally:
            serve.stop(proc)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    table = {}
    print(f"\nvLLM TP{tp} (started in {start_s:.0f} s)")
    print(f"{'path':12s} {'median s':>9s} {'min s':>7s} {'receive s':>10s} {'vLLM load s':>12s} "
          f"{'MiB/worker':>11s} {'trainer extra MiB':>18s}  destination")
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        if not mine:
            continue
        ts = [r["total_s"] for r in mine]
        t = table[path] = {"median_s": statistics.median(ts), "min_s": min(ts), "runs": ts,
                           "receive_s": med([r["receive_s"] for r in mine]),
                           "load_s": med([r["load_s"] for r in mine]),
                           "bytes_per_worker": mine[-1]["bytes_per_worker"],
                           "trainer_extra_bytes": mine[-1]["trainer_extra_bytes"],
                           "destination": mine[-1].get("destination", "vLLM reload_weights"),
                           "ok": all(r["ok"] for r in mine)}
        print(f"{path:12s} {t['median_s']:9.3f} {t['min_s']:7.3f} {_s(t['receive_s']):>10s} {_s(t['load_s']):>12s} "
              f"{t['bytes_per_worker'] / 2**20:11.1f} {t['trainer_extra_bytes'] / 2**20:18.1f}  {t['destination']}")
    return {"vllm_start_s": start_s, "paths": table}


if __name__ == "__main__":
    raise SystemExit(main())
