"""Control plane cost per update: begin/finish through the sync group's store vs over HTTP,
side by side in one run (same engine server, same trainer, alternating connections), for a
model small enough that the data path is not what is measured.

    python benchmarks/control_plane.py --model tiny-qwen3 --updates 30 --out control_plane.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from shardsync.config import ColocatedConfig, ControlConfig, SyncConfig
from shardsync.control.client import wait_healthy
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import load_spec
from shardsync.sync import WeightSync
from shardsync.topology import Topology


def run(control: str, ipc: bool, spec, par, params, url: str, updates: int, first: int) -> dict:
    sync = WeightSync(spec, par, 0, params, [url], SyncConfig(mode="p2p", control=ControlConfig(channel=control),
                                                         colocated=ColocatedConfig() if ipc else None))
    sync.connect()
    try:
        recs = [sync.update(v) for v in range(first, first + updates + 1)][1:]
        bad = sync.verify()
    finally:
        sync.close()
    med = {k: statistics.median(r.phases[k] for r in recs) * 1e3 for k in ("control", "total")}
    return {"control": control, "ipc": ipc, "control_ms": med["control"], "total_ms": med["total"],
            "checksum_ok": not bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--out", default="control_plane.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    spec = load_spec(args.model)
    par = MegatronParallel(tp=1, dtype=spec.dtype)
    engine, url = spawn_server(EngineConfig(model=args.model, port=0))
    rows = []
    try:
        wait_healthy(url, engine, 120)
        params = load_rank(Topology(spec, par).trainer_layout, 0, random_source(spec, 1))
        first = 1
        for _ in range(2):  # alternate twice: drifts of a shared machine hit both
            for ipc in (False, True):
                for control in ("store", "http"):
                    rows.append(run(control, ipc, spec, par, params, url, args.updates, first))
                    first += args.updates + 1
    finally:
        engine.terminate()
        engine.wait(30)
    print(f"{spec.name}, trainer TP1 -> engine TP1, {args.updates} updates per row (medians, ms)")
    print("| transport | control | control ms | whole update ms | checksum |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {'ipc map' if r['ipc'] else 'p2p gloo'} | {r['control']} | {r['control_ms']:.2f} | "
              f"{r['total_ms']:.2f} | {'ok' if r['checksum_ok'] else 'MISMATCH'} |")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "model": spec.name, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
