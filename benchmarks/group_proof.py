"""What authenticating a sync group costs at connect: N processes on loopback (gloo) form a
``SyncGroup`` (signed rendezvous values + every member proving the secret to every peer),
and the proof is then timed again on its own over the formed group.  It runs once per
connect; an update does not touch it (the executor's sends and receives are unchanged).

    python benchmarks/group_proof.py --ranks 2 4 8 --repeat 3 --out group_proof.json
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

from shardsync.launch.procs import run_ranks
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.transport.group import SyncGroup
from shardsync.transport.proof import prove

SECRET = "a-benchmark-secret-0123456789abcdef"


def _rank(rank: int, world: int, port: int, out) -> None:
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, world, "proof-bench", timeout_s=60)
    store = open_store(rdv, is_master=rank == 0)
    store.add("arrived", 1)  # every member started: the clock does not time process start-up
    while store.add("arrived", 0) < world:
        time.sleep(0.001)
    t0 = time.perf_counter()
    group = SyncGroup(rdv, rank, {}, secret=SECRET, store=store)
    formed = time.perf_counter() - t0
    group.barrier()
    t1 = time.perf_counter()
    prove(group.world, world, rank, context="again", secret=SECRET, timeout=rdv.timeout, device=None,
          who=lambda r: f"rank {r}")
    proof = time.perf_counter() - t1
    group.barrier()
    group.close()
    out.put((rank, {"formed_s": formed, "proof_s": proof}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--repeat", type=int, default=3, help="groups formed per size (medians reported)")
    ap.add_argument("--out", default="group_proof.json")
    args = ap.parse_args()
    rows = []
    for world in args.ranks:
        formed, proof = [], []
        for _ in range(args.repeat):
            res = run_ranks(_rank, world, (world, free_port()), timeout_s=300)
            formed.append(max(r["formed_s"] for r in res.values()) * 1e3)  # the slowest member
            proof.append(max(r["proof_s"] for r in res.values()) * 1e3)
        rows.append({"ranks": world, "group_formed_ms": statistics.median(formed),
                     "proof_ms": statistics.median(proof), "proof_rounds": world - 1 + world % 2})
    print(f"sync group on loopback (gloo), medians of {args.repeat}; the slowest member")
    print("| ranks | group formed, proof included (ms) | proof alone (ms) | rounds | per update |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['group_formed_ms']:.1f} | {r['proof_ms']:.2f} | {r['proof_rounds']} | none |")
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/group_proof.py " + " ".join(sys.argv[1:]),
                   "machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus", "rows": rows},
                  f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
