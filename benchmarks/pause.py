"""Engine pause per update, staged vs in place, side by side in one run, with clients
generating the whole time.

One reference engine server per receive kind (``--kinds``: ``in-place`` = staging_bytes 0,
``window`` = ``--window`` of the shard staged, the rest received in place once the engine
paused, ``staged`` = one shard of staging, commit by storage swap) is started up front; then, kind by
kind, client threads generate continuously against it while trainer ranks first idle (the
baseline throughput) and then push ``--updates`` full updates.  Reported per kind: engine
pause per update (p50 / max: the engine ran no forward step because of the update), the
update's time as the trainer sees it, the staged receive and commit times, and generation
throughput (tokens/s) from the first update's start to the last one's end (an update every
``--gap-s``) against the idle baseline (the JSON also has it inside the update windows alone).

    python benchmarks/pause.py                                   # CPU, tiny-qwen3, gloo p2p
    python benchmarks/pause.py --model Qwen3-4B --device cuda    # one GPU: engine and trainer
                                                                 # share it, CUDA IPC (map)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import threading
import time

import httpx
import torch
import torch.distributed as dist

from shardsync.control.client import wait_healthy
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.launch.procs import run_ranks
from shardsync.store.rendezvous import free_port

KINDS = ("in-place", "window", "staged")


def _staging_bytes(kind: str, args: argparse.Namespace) -> int:
    """EngineConfig.staging_bytes of a kind (a window: its share of worker 0's shard)."""
    if kind != "window":
        return {"in-place": 0, "staged": -1}[kind]
    from shardsync.layout import EngineParallel, engine_layout
    from shardsync.plan.plan import dtype_itemsize
    from shardsync.presets import load_spec

    spec = load_spec(args.model, dtype=args.dtype)
    lay = engine_layout(spec, EngineParallel(tp=args.engine_tp, dtype=spec.dtype))
    return int(args.window * sum(t.numel for t in lay.ranks[0].tensors) * dtype_itemsize(spec.dtype))


def _trainer(rank: int, world: int, port: int, url: str, args: argparse.Namespace, out) -> None:
    from shardsync.config import ColocatedConfig, ControlConfig, SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.models.weights import load_rank
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=900))
    spec = load_spec(args.model, dtype=args.dtype)
    par = MegatronParallel(tp=world, dtype=args.dtype)
    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    params = load_rank(Topology(spec, par).trainer_layout, rank, _source(spec, args), device=device)
    config = SyncConfig(mode="p2p", transport=TransportConfig(bucket_mb=args.bucket_mb, timeout_s=600),
                        colocated=ColocatedConfig(ipc="map") if cuda else None,
                        control=ControlConfig(channel="store", http_timeout_s=600))
    sync = WeightSync(spec, par, rank, params, [url], config, trainer_group=dist.group.WORLD)
    sync.connect()
    sync.update(1)  # warm: the first update compiles and maps
    idle = [time.monotonic()]
    time.sleep(args.idle_s)
    idle.append(time.monotonic())
    windows, records = [], []
    first = next(iter(params.values()))
    for v in range(2, args.updates + 2):
        with torch.no_grad():
            first.view(-1)[v % first.numel()] += 1.0  # a change every update
        if cuda:
            torch.cuda.synchronize()
        t0 = time.monotonic()
        rec = sync.update(v)
        windows.append((t0, time.monotonic()))
        records.append({"ok": rec.ok, "total_s": rec.total_s, "engines": rec.engines_json()})
        time.sleep(args.gap_s)
    bad = sync.verify()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"idle": idle, "windows": windows, "records": records, "checksum_ok": not bad}))


def _source(spec, args: argparse.Namespace):
    """Random trainer weights (the first update overwrites the engine's own); on a GPU drawn
    on the device (a 4B model in seconds)."""
    from shardsync.models.weights import random_source

    if args.device != "cuda":
        return random_source(spec, args.seed)
    from gpu_update import fast_source  # benchmarks/ is this script's directory

    return fast_source(spec, args.seed)


def _clients(url: str, args: argparse.Namespace, stop: threading.Event, got: list, errors: list) -> list:
    def run(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=600) as http:
            while not stop.is_set():
                body = {"prompts": [[rng.randrange(1, 100) for _ in range(8)]],
                        "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "seed": rng.randrange(2**31)}
                r = http.post(url + "/generate", json=body)
                if r.status_code != 200:
                    errors.append(r.text[:200])
                    continue
                out = r.json()["outputs"][0]
                got.append((time.monotonic(), len(out["tokens"]), len(out["spans"])))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(args.clients)]
    for t in threads:
        t.start()
    return threads


def _throughput(got: list, windows: list[tuple[float, float]]) -> float:
    """Tokens/s of responses that completed inside ``windows``."""
    span = sum(b - a for a, b in windows)
    tokens = sum(n for t, n, _ in got if any(a <= t <= b for a, b in windows))
    return tokens / span if span > 0 else 0.0


def bench_kind(kind: str, url: str, args: argparse.Namespace) -> dict:
    stop = threading.Event()
    got: list[tuple[float, int, int]] = []  # (time, tokens, spans) per response
    errors: list[str] = []
    threads = _clients(url, args, stop, got, errors)
    try:
        res = run_ranks(_trainer, args.trainer_tp, (args.trainer_tp, free_port(), url, args))
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    r0 = res[0]
    engines = [rec["engines"][0] for rec in r0["records"]]
    pauses = sorted(e["pause_s"] for e in engines)
    totals = sorted(rec["total_s"] for rec in r0["records"])
    windows = [tuple(w) for w in r0["windows"]]
    return {
        "kind": kind, "updates": len(engines), "ok": all(rec["ok"] for rec in r0["records"]),
        "checksum_ok": all(r["checksum_ok"] for r in res.values()), "client_errors": errors[:5],
        "pause_p50_s": statistics.median(pauses), "pause_max_s": pauses[-1],
        "update_p50_s": statistics.median(totals), "update_max_s": totals[-1],
        "stage_p50_s": statistics.median(e["stage_s"] for e in engines),
        "commit_p50_s": statistics.median(e["commit_s"] for e in engines),
        "drain_p50_s": statistics.median(e["drain_s"] for e in engines),
        "staging_bytes": max(e["staging_bytes"] for e in engines), "staging": engines[0]["staging"],
        "shard_bytes": max(e.get("shard_bytes", 0) for e in engines),
        "tokens_per_s_idle": _throughput(got, [tuple(r0["idle"])]),
        "tokens_per_s_in_update_windows": _throughput(got, windows),
        "tokens_per_s_while_updating": _throughput(got, [(windows[0][0], windows[-1][1])]),
        "responses": len(got), "responses_spanning": sum(1 for *_, s in got if s > 1),
        "pauses_s": pauses,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--kinds", default="in-place,window,staged", help=f"a comma list of {', '.join(KINDS)}")
    ap.add_argument("--window", type=float, default=0.5, help="window kind: share of the shard staged")
    ap.add_argument("--trainer-tp", type=int, default=1)
    ap.add_argument("--engine-tp", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--idle-s", type=float, default=3.0, help="baseline: serving with no update")
    ap.add_argument("--gap-s", type=float, default=0.3, help="serving time between updates")
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--crossing", default="finish", choices=["finish", "span", "abort"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine worker")
    ap.add_argument("--out", default="pause.json")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    kinds = args.kinds.split(",")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        ap.error(f"unknown kind(s) {unknown}: choose from {KINDS}")
    servers = {}
    try:
        for kind in kinds:  # all engines load at once
            cfg = EngineConfig(model=args.model, tp=args.engine_tp, port=free_port(), dtype=args.dtype,
                               device=args.device, seed=args.seed, staging_bytes=_staging_bytes(kind, args),
                               crossing=args.crossing, threads=args.threads)
            servers[kind] = spawn_server(cfg)
        for proc, url in servers.values():
            wait_healthy(url, proc, 1800)
        results = [bench_kind(kind, servers[kind][1], args) for kind in kinds]
    finally:
        for proc, _ in servers.values():
            proc.terminate()
        for proc, _ in servers.values():
            proc.wait(60)
    where = (torch.cuda.get_device_name() if args.device == "cuda"
             else f"{platform.node()} {os.cpu_count()} cpus")
    print(f"{args.model} {args.dtype}, trainer TP{args.trainer_tp} -> engine TP{args.engine_tp} on {where}; "
          f"{args.updates} updates, {args.clients} clients generating {args.max_new_tokens} tokens per request, "
          f"crossing={args.crossing}")
    print(f"{'kind':<9} {'pause p50 ms':>12} {'pause max ms':>12} {'update p50 ms':>13} {'stage p50 ms':>12} "
          f"{'commit p50 ms':>13} {'drain p50 ms':>12} {'tok/s idle':>10} {'tok/s updating':>14} {'staging MiB':>11} "
          f"{'checksum':>8}")
    for r in results:
        print(f"{r['kind']:<9} {r['pause_p50_s'] * 1e3:>12.2f} {r['pause_max_s'] * 1e3:>12.2f} "
              f"{r['update_p50_s'] * 1e3:>13.1f} {r['stage_p50_s'] * 1e3:>12.1f} {r['commit_p50_s'] * 1e3:>13.2f} "
              f"{r['drain_p50_s'] * 1e3:>12.1f} {r['tokens_per_s_idle']:>10.1f} "
              f"{r['tokens_per_s_while_updating']:>14.1f} {r['staging_bytes'] / 2**20:>11.1f} "
              f"{'ok' if r['checksum_ok'] and r['ok'] else 'FAIL':>8}")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "machine": where, "torch": torch.__version__,
                   "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
