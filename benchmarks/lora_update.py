"""Adapter sync vs full sync, side by side in one run: for one model, an engine server and trainer
ranks (Megatron layout, fp32 masters) sync the whole model; then LoRA adapters of each rank,
alone, into an engine serving them with a LoRA term, and into one that merges them into its
base (``--lora-merge``: no LoRA kernel, base + scale * B @ A served).  Every engine stages whole
shards, so the pause is the swap (the merge runs before it, as ``derive``).  Reports per case
the median update time, the bytes moved, the engine's pause and merge time, checksums.

    python benchmarks/lora_update.py --model Qwen2.5-0.5B --rank 8 --rank 64 --updates 5
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
from shardsync.lora import Lora
from shardsync.store.rendezvous import free_port

# (case name, LoRA rank or 0 for the whole model, merged into the base)
Case = tuple[str, int, bool]


def _engine(model: str, args: argparse.Namespace, lora: Lora | None, merge: bool) -> tuple[subprocess.Popen, str]:
    proc, url = spawn_server(EngineConfig(model=model, tp=args.engine_tp, port=free_port(), staging_bytes=-1,
                                          lora=lora, lora_merge=merge))
    wait_healthy(url, proc, 900)
    return proc, url


def _trainer(rank: int, world: int, port: int, url: str, args: argparse.Namespace, lora: Lora | None, out) -> None:
    from shardsync.config import SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.lora import adapter_tensors
    from shardsync.models.weights import load_rank, random_source
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    spec = load_spec(args.model)
    par = MegatronParallel(tp=args.trainer_tp, dtype="float32")
    topo = Topology(spec, par, lora=lora)
    shapes = None if lora is None else adapter_tensors(spec, lora)
    params = load_rank(topo.trainer_layout, rank, random_source(spec, 0, shapes=shapes))
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(lora=lora, transport=TransportConfig(bucket_mb=args.bucket_mb, timeout_s=600)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    rows = []
    for version in range(1, args.warmup + args.updates + 1):
        for t in params.values():  # a new version of every synced tensor (a training step's worth)
            t.add_(1e-4)
        rec = sync.update(version, mode="p2p")
        if version > args.warmup:
            rows.append({"total_s": rec.total_s, "pause_s": rec.pause_s, "bytes": sum(rec.link_bytes.values()),
                         "derive_s": rec.phases.get("derive", 0.0), "adapter": rec.adapter})
    ok = sync.verify() == []
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"rows": rows, "checksum_ok": ok}))


def bench_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    name, rank, merge = case
    lora = Lora(rank, 2.0 * rank) if rank else None
    proc, url = _engine(args.model, args, lora, merge)
    try:
        res = run_ranks(_trainer, args.trainer_tp, (args.trainer_tp, free_port(), url, args, lora))
    finally:
        proc.terminate()
        proc.wait(60)
    rows = res[0]["rows"]
    return {"case": name, "lora_rank": rank, "merge": merge,
            "median_s": statistics.median(r["total_s"] for r in rows),
            "pause_median_s": statistics.median(r["pause_s"] for r in rows),
            "merge_median_s": statistics.median(r["derive_s"] for r in rows),
            "bytes": rows[0]["bytes"], "adapter": rows[0]["adapter"], "n": len(rows),
            "checksum_ok": all(r["checksum_ok"] for r in res.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B", help="preset or config.json")
    ap.add_argument("--rank", type=int, action="append", help="LoRA ranks (repeatable; default 8 and 64)")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=5, help="measured updates per case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--no-merge", action="store_true", help="skip the merging engines")
    ap.add_argument("--out", default="lora_update.json")
    args = ap.parse_args()
    ranks = args.rank or [8, 64]
    cases: list[Case] = [("full model", 0, False)]
    cases += [(f"adapter r{r}", r, False) for r in ranks]
    cases += [] if args.no_merge else [(f"merge r{r}", r, True) for r in ranks]
    results = [bench_case(c, args) for c in cases]
    MiB = 2**20
    print(f"{args.model}: trainer TP{args.trainer_tp} -> reference engine TP{args.engine_tp} (staged), p2p, "
          f"{args.updates} measured updates per case")
    print(f"{'case':<14} {'median ms':>10} {'MiB moved':>10} {'vs full':>8} {'pause ms':>9} {'merge ms':>9} "
          f"{'checksum':>9}")
    full = results[0]
    for r in results:
        print(f"{r['case']:<14} {r['median_s'] * 1e3:>10.1f} {r['bytes'] / MiB:>10.2f} "
              f"{r['bytes'] / full['bytes']:>8.3f} {r['pause_median_s'] * 1e3:>9.2f} "
              f"{r['merge_median_s'] * 1e3:>9.1f} {'ok' if r['checksum_ok'] else 'MISMATCH':>9}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
