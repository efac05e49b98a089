"""What the per-message digest (``TransportConfig(verify_buckets=True)``) costs, side by side in
one run: a real gloo world of trainer and engine ranks compiles every path twice (digests off
and on) over one sync group and alternates them update by update.

    python benchmarks/wire_check.py --model tiny-qwen3 --model Qwen2.5-0.5B --updates 10

Prints median update time per (path, digests) and the overhead, plus the digest's own
throughput in this process; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

MODES = ("p2p", "broadcast")


def _rank(rank: int, world: int, port: int, model: str, args, out) -> None:
    from shardsync.layout import EngineParallel, MegatronParallel
    from shardsync.mode import Mode
    from shardsync.models.weights import load_rank, random_source
    from shardsync.paths import Endpoint, UpdateArgs, compile_path
    from shardsync.presets import load_spec
    from shardsync.runtime.schedule import subgroups
    from shardsync.store.rendezvous import Rendezvous, open_store
    from shardsync.store.secret import load_secret
    from shardsync.topology import Topology
    from shardsync.transport import SyncGroup

    torch.set_num_threads(1)
    spec = load_spec(model)
    topo = Topology(spec, MegatronParallel(tp=args.trainer_tp, dtype="float32"), (EngineParallel(tp=args.engine_tp),))
    rdv = Rendezvous("127.0.0.1", port, world, "wire", timeout_s=600)
    group_secret = load_secret().value
    group = SyncGroup(rdv, rank, subgroups(topo), secret=group_secret,
                      store=open_store(rdv, is_master=True) if rank == 0 else None)
    T = topo.trainer.world_size
    src = random_source(spec, seed=1)
    local = (load_rank(topo.trainer_layout, rank, src) if rank < T
             else load_rank(topo.engine_layouts[0], rank - T, random_source(spec, seed=2)))
    programs = {(m, v): compile_path(Mode(m), Endpoint(topo, rank, group, int(args.bucket_mb * 2**20), verify=v,
                                                                 secret=group_secret))
                for m in MODES for v in (False, True)}
    times: dict[str, list[float]] = {f"{m}/{v}": [] for m, v in programs}
    order = list(programs)
    for i in range(args.warmup + args.updates):
        for key in order if i % 2 == 0 else order[::-1]:
            group.barrier()
            t0 = time.perf_counter()
            programs[key].run(local, UpdateArgs(version=i))
            group.barrier()
            if i >= args.warmup:
                times[f"{key[0]}/{key[1]}"].append(time.perf_counter() - t0)
    bad = []
    if rank >= T:
        expect = load_rank(topo.engine_layouts[0], rank - T, src)
        bad = [k for k in expect if not torch.equal(expect[k], local[k])]
    group.close()
    out.put((rank, {"times": times, "bad": bad, "bytes": topo.p2p_plan.total_bytes}))


def digest_GBps(nbytes: int = 256 * 2**20) -> float:
    from shardsync.runtime.executor import digest

    buf = torch.randn(nbytes // 4)
    digest(buf)
    t0 = time.perf_counter()
    for _ in range(5):
        digest(buf)
    return 5 * nbytes / (time.perf_counter() - t0) / 1e9


def bench(model: str, args) -> dict:
    from shardsync.launch.procs import run_ranks
    from shardsync.store.rendezvous import free_port

    world = args.trainer_tp + args.engine_tp
    res = run_ranks(_rank, world, (world, free_port(), model, args))
    times = res[0]["times"]
    row = {"model": model, "bytes": res[0]["bytes"], "bitwise": all(not r["bad"] for r in res.values())}
    for m in MODES:
        off, on = statistics.median(times[f"{m}/False"]), statistics.median(times[f"{m}/True"])
        row[m] = {"off_ms": off * 1e3, "on_ms": on * 1e3, "overhead": on / off - 1}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--out", default="wire_check.json")
    args = ap.parse_args()
    rows = [bench(m, args) for m in args.model or ["tiny-qwen3", "Qwen2.5-0.5B"]]
    gbps = digest_GBps()
    print(f"trainer TP{args.trainer_tp} -> engine TP{args.engine_tp}, bucket {args.bucket_mb} MiB, {args.updates} "
          f"updates per (path, digests), alternating; digest alone: {gbps:.1f} GB/s in this process")
    print(f"{'model':<14} {'path':<10} {'off ms':>8} {'on ms':>8} {'overhead':>9}  bitwise")
    for r in rows:
        for m in MODES:
            print(f"{r['model']:<14} {m:<10} {r[m]['off_ms']:>8.1f} {r[m]['on_ms']:>8.1f} {r[m]['overhead']:>8.1%}  "
                  f"{'ok' if r['bitwise'] else 'MISMATCH'}")
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/wire_check.py " + " ".join(sys.argv[1:]),
                   "machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "torch": torch.__version__, "digest_GBps": gbps, "results": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
