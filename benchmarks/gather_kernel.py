"""The map path's copy kernel alone, in one process on one GPU: every tuning of
``transport.gather.Gather`` in the sweep over the same (destination, source) pairs the engine
compiles for a model, side by side with one flat D2D copy of the same bytes (the limit) and
the per-copy launches; each tuning's result checked bitwise against the per-copy path, and
the CPU time one launch takes (what the engine spends before the GPU starts).

    cd benchmarks && python gather_kernel.py --model Qwen3-4B --out gather_kernel.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import torch
from gpu_update import cuda_ms, d2d_copy_ms, fast_source

from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank
from shardsync.plan.local import allocate
from shardsync.plan.runs import coalesce, compile_runs
from shardsync.presets import load_spec
from shardsync.topology import Topology
from shardsync.transport.copies import SIDE_STREAMS, Copies
from shardsync.transport.gather import Gather, Tuning, capture

KiB = 1 << 10


def sweep(quick: bool = False, fine: bool = False) -> list[Tuning]:
    """Around the defaults: tile and loop step sizes, cache hints, persistent programs
    (``quick``: the defaults and their nearest neighbours; ``fine``: tiles of 4 to 32 KiB,
    where the 14B sweep found smaller tiles faster: fewer bytes in flight across the device)."""
    if fine:
        shapes = [(32, 8, 16), (32, 16, 32), (16, 4, 16), (16, 8, 16), (16, 16, 16), (16, 8, 8), (16, 16, 32),
                  (8, 4, 8), (8, 8, 8), (8, 8, 16), (8, 8, 4), (4, 4, 4), (4, 4, 8)]
        return [Tuning(tile_bytes=t * KiB, block_bytes=b * KiB, num_warps=w) for t, b, w in shapes] + [
            Tuning(tile_bytes=16 * KiB, streaming=False)]
    if quick:
        return [Tuning(), Tuning(streaming=False), Tuning(tile_bytes=16 * KiB), Tuning(tile_bytes=64 * KiB),
                Tuning(tile_bytes=64 * KiB, block_bytes=16 * KiB), Tuning(block_bytes=16 * KiB),
                Tuning(num_warps=8), Tuning(tile_bytes=128 * KiB, block_bytes=16 * KiB)]
    grid = itertools.product((64 * KiB, 256 * KiB), (8 * KiB, 16 * KiB), (False, True), (0, 2, 4))
    tunings = [Tuning(tile_bytes=t, block_bytes=b, streaming=s, per_sm=p) for t, b, s, p in grid]
    return tunings + [Tuning(num_warps=8, streaming=s, per_sm=p) for s, p in ((False, 0), (True, 0), (True, 4))]


def launch_us(fn, n: int = 20) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def sweep_rows(rows: list[dict]) -> list[tuple[Tuning, float]]:
    """The swept gather rows as (tuning, ms), bitwise ones only."""
    fields = Tuning.__dataclass_fields__
    return [(Tuning(**{k: r[k] for k in fields if k in r}), r["ms"]) for r in rows
            if r["kernel"] == "gather" and r["bitwise"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="only the defaults and their nearest neighbours")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over the sweep (each tuning: their median)")
    ap.add_argument("--fine", action="store_true", help="tiles of 4 to 32 KiB (instead of the wide sweep)")
    ap.add_argument("--out", default="gather_kernel.json")
    args = ap.parse_args()
    spec = load_spec(args.model, dtype="bfloat16")
    topo = Topology(spec, MegatronParallel(tp=1, dtype="bfloat16"))
    plan = topo.p2p_plan
    nbytes = plan.total_bytes
    d2d = d2d_copy_ms(nbytes)
    params = load_rank(topo.trainer_layout, 0, fast_source(spec, 1), device="cuda")
    torch.cuda.empty_cache()
    engine = allocate(plan, 0, device="cuda")
    runs = coalesce(plan.copies)
    pairs = compile_runs(runs, params, engine)
    per_copy = Copies.of(pairs, gather=False)
    streams = [torch.cuda.Stream() for _ in range(SIDE_STREAMS)]
    rows: list[dict[str, Any]] = [
        {"kernel": "one flat D2D copy (the limit)", "ms": d2d},
        {"kernel": f"per-copy launches, {1 + SIDE_STREAMS} streams", "ms": cuda_ms(lambda: per_copy.run(streams)),
         "launch_us": launch_us(lambda: per_copy.run(streams))}]
    reference = {n: t.clone() for n, t in engine.items()}
    for side in (streams, streams[:0]):  # the driver's copies, one launch: a graph of memcpy nodes
        graph = capture(lambda side=side: per_copy.run(side), torch.device("cuda", torch.cuda.current_device()))
        rows.append({"kernel": f"per-copy memcpys as one graph, {1 + len(side)} stream(s)", "ms": cuda_ms(graph.replay),
                     "launch_us": launch_us(graph.replay)})
        del graph
    gathers = {tuning: Gather(pairs, tuning) for tuning in sweep(args.quick, args.fine)}
    times: dict[Tuning, list[float]] = {tuning: [] for tuning in gathers}
    ok = dict.fromkeys(gathers, True)
    for _ in range(args.repeat):  # rounds over every tuning: a slow spell of the device hits them all
        for tuning, g in gathers.items():
            for t in engine.values():
                t.zero_()
            times[tuning].append(cuda_ms(g.run, iters=args.iters))
            torch.cuda.synchronize()
            ok[tuning] &= all(torch.equal(engine[n].view(torch.uint8), reference[n].view(torch.uint8)) for n in engine)
    for tuning, g in gathers.items():
        rows.append({"kernel": "gather", **tuning.__dict__, "programs": g.programs,
                     "ms": statistics.median(times[tuning]), "rounds_ms": times[tuning],
                     "launch_us": launch_us(g.run), "bitwise": ok[tuning]})
    gathers.clear()
    # push's launch: the largest source tensor's copies first, the rest (checked meanwhile) next
    largest = max(sorted(params), key=lambda n: params[n].numel() * params[n].element_size())
    for tuning in dict.fromkeys([Tuning(), min(sweep_rows(rows), key=lambda r: r[1])[0]]):
        parts = [Gather(compile_runs([r for r in runs if (r.first.src_local == largest) == lead], params, engine),
                        tuning) for lead in (True, False)]
        for t in engine.values():
            t.zero_()
        ms = cuda_ms(lambda parts=parts: [g.run() for g in parts], iters=args.iters)
        torch.cuda.synchronize()
        same = all(torch.equal(engine[n].view(torch.uint8), reference[n].view(torch.uint8)) for n in engine)
        rows.append({"kernel": "gather, largest tensor first (2 launches)", **tuning.__dict__,
                     "programs": sum(g.programs for g in parts), "ms": ms,
                     "launch_us": launch_us(lambda parts=parts: [g.run() for g in parts]), "bitwise": same})
    for r in rows:
        r["GBps"] = nbytes / r["ms"] / 1e6
        r["x_d2d"] = r["ms"] / d2d
    print(f"{spec.name}: {nbytes / 2**30:.2f} GiB, {len(pairs)} copies; medians of {args.iters} launches")
    print(f"{'kernel':<40} {'tile':>5} {'block':>5} {'warps':>5} {'strm':>4} {'/SM':>3} {'ms':>7} {'GB/s':>6} "
          f"{'x D2D':>6} {'launch us':>9} ok")
    for r in sorted(rows, key=lambda r: r["ms"]):
        t = (f"{r['tile_bytes'] // KiB:>4}K {r['block_bytes'] // KiB:>4}K {r['num_warps']:>5} "
             f"{'y' if r['streaming'] else 'n':>4} {r['per_sm']:>3}") if r["kernel"].startswith("gather") else " " * 28
        print(f"{r['kernel']:<40} {t} {r['ms']:7.3f} {r['GBps']:6.0f} {r['x_d2d']:6.3f} "
              f"{r.get('launch_us', float('nan')):9.1f} {r.get('bitwise', '')}")
    best = min((r for r in rows if r["kernel"] == "gather" and r["bitwise"]), key=lambda r: r["ms"])
    print(f"best gather: {best['ms']:.3f} ms = {best['x_d2d']:.3f}x D2D ({best['GBps']:.0f} GB/s)")
    out = {"model": spec.name, "bytes": nbytes, "copies": len(pairs), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "rows": rows, "best": best}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
