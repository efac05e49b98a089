"""P2P vs broadcast update time, side by side in one run, through the full stack.

An engine server (subprocess, TP workers) and trainer ranks (spawned, fp32 master weights,
Megatron layout) connect once; then updates alternate p2p / broadcast so both modes see
the same machine state.  Reports the median (and p90) of the measured updates per mode,
the p2p/broadcast ratio, per-phase times, and each rank's executor buffer peak (the extra
memory an update needs: p2p stays within credits x bucket on every trainer rank; the
broadcast source also holds gather buffers).

    python benchmarks/sync_modes.py --model tiny-qwen3 --model Qwen2.5-0.5B --updates 10

On GPUs (trainer rank r on cuda:r, the engine's TP workers on the GPUs after them), e.g.
trainer TP 4 on GPUs 0-3 and an engine of TP 4 on GPUs 4-7 with NCCL sync groups:

    python benchmarks/sync_modes.py --model Qwen3-4B --trainer-tp 4 --engine-tp 4 \
        --device cuda --backend nccl --dtype bfloat16 --warmup 5 --updates 20

(``--engine-tp 2 --engines 2`` for two engines of TP 2 on GPUs 4-5 and 6-7.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
from typing import Any

import torch
import torch.distributed as dist

from shardsync.control.client import wait_healthy
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.launch.procs import run_ranks
from shardsync.store.rendezvous import free_port


def _engine(model: str, tp: int, index: int, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    # on GPUs: the ones after the trainer's and earlier engines' (wrapping)
    device = f"cuda:{args.trainer_tp + index * tp}" if args.device == "cuda" else "cpu"
    proc, url = spawn_server(EngineConfig(model=model, tp=tp, ep=args.engine_ep, port=0, dtype=args.dtype,
                                          device=device, quantization=args.engine_quantization))
    wait_healthy(url, proc, 900)
    return proc, url


def _trainer(rank: int, world: int, port: int, urls: list[str], args: argparse.Namespace, model: str,
             out) -> None:
    from shardsync.config import SyncConfig, TransportConfig
    from shardsync.layout import Fsdp2Parallel, MegatronParallel
    from shardsync.models.weights import load_rank, random_source
    from shardsync.placement import rank_device
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))
    spec = load_spec(model, dtype=args.dtype)
    if args.trainer == "fsdp2":  # FSDP2's row blocks (the layout tests/dist/test_fsdp2.py checks on real DTensors)
        par = Fsdp2Parallel(shard=args.trainer_dp, dtype=args.dtype or "float32")
    else:
        par = MegatronParallel(tp=args.trainer_tp, dp=args.trainer_dp, ep=args.trainer_ep, etp=args.trainer_etp,
                               dtype=args.dtype or "float32")
    device = rank_device(args.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    params = load_rank(Topology(spec, par).trainer_layout, rank, random_source(spec, 0), device=device)
    sync = WeightSync(spec, par, rank, params, urls,
                      SyncConfig(transport=TransportConfig(bucket_mb=args.bucket_mb, credits=args.credits,
                                                           timeout_s=600, backend=args.backend,
                                                           verify_buckets=args.verify_buckets)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    rows = []
    version = 0
    for i in range(args.warmup + args.updates):
        for mode in ("p2p", "broadcast") if i % 2 == 0 else ("broadcast", "p2p"):
            version += 1
            rec = sync.update(version, mode=mode)
            if i >= args.warmup:
                rows.append({"mode": mode, "phases": rec.phases, "buffer_bytes": rec.buffer_bytes,
                             "engine_derive_s": max((e.derive_s for e in rec.engines), default=0.0),
                             "engine_buffer_bytes": max((e.buffer_bytes for e in rec.engines), default=0),
                             "busiest": rec.busiest_link_bytes, "bytes": sum(rec.link_bytes.values())})
    ok = sync.verify() == []
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"rows": rows, "checksum_ok": ok}))


def bench_model(model: str, args: argparse.Namespace) -> dict:
    engines = [_engine(model, args.engine_tp, i, args) for i in range(args.engines)]
    urls = [u for _, u in engines]
    try:
        world = (1 if args.trainer == "fsdp2" else args.trainer_tp) * args.trainer_dp
        res = run_ranks(_trainer, world, (world, free_port(), urls, args, model))
    finally:
        for proc, _ in engines:
            proc.terminate()
        for proc, _ in engines:
            proc.wait(60)
    summary: dict[str, Any] = {"model": model, "checksum_ok": all(r["checksum_ok"] for r in res.values()), "modes": {}}
    for mode in ("p2p", "broadcast"):
        rows0 = [r for r in res[0]["rows"] if r["mode"] == mode]
        totals = sorted(r["phases"]["total"] for r in rows0)
        summary["modes"][mode] = {
            "median_s": statistics.median(totals),
            "p90_s": totals[min(len(totals) - 1, int(0.9 * len(totals)))],
            "p99_s": totals[min(len(totals) - 1, int(0.99 * len(totals)))],
            "n": len(totals),
            "phases_median_s": {k: statistics.median(r["phases"][k] for r in rows0)
                                for k in ("pack", "transfer", "unpack", "derive", "quantize", "control")},
            "busiest_link_bytes": rows0[0]["busiest"], "bytes": rows0[0]["bytes"],
            "buffer_bytes_per_trainer_rank": {r: max(x["buffer_bytes"] for x in v["rows"] if x["mode"] == mode)
                                              for r, v in sorted(res.items())},
            "engine_buffer_bytes": max(r["engine_buffer_bytes"] for r in rows0),
        }
    summary["ratio_p2p_over_broadcast"] = (summary["modes"]["p2p"]["median_s"]
                                           / summary["modes"]["broadcast"]["median_s"])
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="preset or config.json (repeatable)")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--trainer", default="megatron", choices=["megatron", "fsdp2"],
                    help="fsdp2: --trainer-dp ranks hold FSDP2 row blocks; broadcast is then gather-then-broadcast")
    ap.add_argument("--trainer-dp", type=int, default=1)
    ap.add_argument("--trainer-ep", type=int, default=1, help="expert parallel (MoE models)")
    ap.add_argument("--trainer-etp", type=int, default=None, help="expert tensor parallel (default: trainer TP)")
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--engine-ep", type=int, default=1, help="engine expert parallel (MoE models)")
    ap.add_argument("--engines", type=int, default=1, help="engines of --engine-tp each")
    ap.add_argument("--updates", type=int, default=10, help="measured updates per mode")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--credits", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: trainer rank r on GPU r, the engine on the GPUs after them")
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl"], help="sync group backend")
    ap.add_argument("--dtype", default=None, help="weights dtype (default: fp32 trainer, the model's engine)")
    ap.add_argument("--verify-buckets", action="store_true", help="a digest after every message, checked")
    ap.add_argument("--engine-quantization", default=None,
                    help="engines serve FP8 in this format (shardsync.quant.FORMATS, e.g. fp8): the trainer "
                         "quantizes what it sends (quant column) and engines what arrives wide (derive column)")
    ap.add_argument("--out", default="sync_modes.json")
    args = ap.parse_args()
    models = args.model or ["tiny-qwen3", "Qwen2.5-0.5B"]
    results = [bench_model(m, args) for m in models]
    MiB = 2**20
    trainer = (f"FSDP2 shard {args.trainer_dp}" if args.trainer == "fsdp2"
               else f"TP{args.trainer_tp} DP{args.trainer_dp} EP{args.trainer_ep} "
                    f"ETP{args.trainer_etp or args.trainer_tp}")
    print(f"trainer {trainer} -> {args.engines} engine(s) of "
          f"TP{args.engine_tp} EP{args.engine_ep}"
          f"{f' serving {args.engine_quantization}' if args.engine_quantization else ''}, bucket {args.bucket_mb} MiB, "
          f"credits {args.credits}, {args.updates} measured updates per mode (alternating)")
    print(f"{'model':<14} {'mode':<10} {'median ms':>10} {'p90 ms':>8} {'p99 ms':>8} {'pack':>7} {'xfer':>7} "
          f"{'unpack':>7} {'derive':>7} {'quant':>6} {'ctl':>6} {'wire MiB':>9} {'busiest MiB':>11} "
          f"{'trainer buf MiB (per rank)':>27} "
          f"{'engine buf MiB':>14}")
    for r in results:
        for mode, m in r["modes"].items():
            ph = m["phases_median_s"]
            bufs = "/".join(f"{b / MiB:.1f}" for b in m["buffer_bytes_per_trainer_rank"].values())
            print(f"{r['model']:<14} {mode:<10} {m['median_s'] * 1e3:>10.1f} {m['p90_s'] * 1e3:>8.1f} "
                  f"{m['p99_s'] * 1e3:>8.1f} "
                  f"{ph['pack'] * 1e3:>7.1f} {ph['transfer'] * 1e3:>7.1f} {ph['unpack'] * 1e3:>7.1f} "
                  f"{ph['derive'] * 1e3:>7.1f} {ph['quantize'] * 1e3:>6.1f} "
                  f"{ph['control'] * 1e3:>6.1f} {m['bytes'] / MiB:>9.1f} {m['busiest_link_bytes'] / MiB:>11.1f} "
                  f"{bufs:>27} "
                  f"{m['engine_buffer_bytes'] / MiB:>14.1f}")
        print(f"{r['model']:<14} p2p/broadcast = {r['ratio_p2p_over_broadcast']:.2f}   "
              f"checksum {'ok' if r['checksum_ok'] else 'MISMATCH'}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
