"""P2P vs broadcast for every topology of issue 5, in the same run, through the full stack.

Per topology: engine server(s) (``shardsync engine serve`` subprocesses with their TP
workers) and spawned trainer ranks (Megatron layout, fp32 master weights) connect once
with ``WeightSync(mode="auto")``; then updates alternate p2p / broadcast (the order flips
every round so neither mode always runs first) after ``--warmup`` rounds.  Weights change
before every update and every update is checked bitwise (``WeightSync.verify``).
Prints a markdown table (median update time per mode, p2p/broadcast ratio, busiest-link
bytes per mode, checksum) and writes every measured record's phases to JSON.

    python benchmarks/topologies.py                   # all topologies, ~3-6 min on 2 cores
    python benchmarks/topologies.py --only tp2-tp4-kvrep --updates 10
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
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.demo.run import DemoConfig, start_engines
from shardsync.presets import PRESETS
from shardsync.store.rendezvous import free_port as _free_port

MODES = ("p2p", "broadcast")


@dataclass(frozen=True, kw_only=True)
class Case:
    model: str
    tp: int = 1
    pp: int = 1
    pp_layers: tuple[int, ...] | None = None
    engines: tuple[int, ...] = (1,)
    mqa: bool = False  # model = the preset with one KV head, as a config.json on disk
    what: str = ""


CASES = {
    "tp1pp2": Case(model="tiny-qwen3", pp=2, engines=(1,), what="PP 2, stages send concurrently"),
    "tp2pp2": Case(model="tiny-qwen3", tp=2, pp=2, engines=(2,), what="TP 2 x PP 2"),
    "pp3-uneven": Case(model="tiny-llama", pp=3, pp_layers=(2, 1, 1), engines=(1,),
                       what="PP 3, layers 2/1/1"),
    "tp2-tp1": Case(model="tiny-qwen3", tp=2, engines=(1,), what="engine TP below trainer TP"),
    "tp2-tp4-kvrep": Case(model="tiny-qwen3", tp=2, engines=(4,), what="2 KV heads on 4 ranks"),
    "tp4-tp2": Case(model="tiny-llama", tp=4, engines=(2,), what="trainer TP above engine TP"),
    "tp1-tp4": Case(model="tiny-qwen2", tp=1, engines=(4,), what="one trainer rank feeds 4"),
    "mqa-tp1-tp4": Case(model="tiny-llama", tp=1, engines=(4,), mqa=True, what="1 KV head on 4 ranks"),
    "tp2-engines2+1": Case(model="tiny-qwen3", tp=2, engines=(2, 1), what="two engines, TP 2 and TP 1"),
}


def _model_arg(case: Case, tmp: Path) -> str:
    """A preset name, or for MQA a config.json that engine and trainer both load."""
    if not case.mqa:
        return case.model
    spec = PRESETS[case.model].replace(num_kv_heads=1)
    path = tmp / f"{case.model}-mqa" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec.to_hf_config(), indent=2))
    return str(path)


def _trainer(rank: int, port: int, urls: list[str], case: Case, model: str,
             args: argparse.Namespace, out) -> None:
    from shardsync.config import SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.models.weights import load_rank, random_source
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    par = MegatronParallel(tp=case.tp, pp=case.pp, pp_layers=case.pp_layers, dtype="float32")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=par.world_size, timeout=datetime.timedelta(seconds=600))
    spec = load_spec(model)
    params = load_rank(Topology(spec, par).trainer_layout, rank, random_source(spec, 0))
    sync = WeightSync(spec, par, rank, params, urls,
                      SyncConfig(transport=TransportConfig(bucket_mb=args.bucket_mb, credits=args.credits,
                                                           timeout_s=600)), trainer_group=dist.group.WORLD)
    sync.connect()
    modes = [m for m in MODES if m in sync.modes]
    rows, bad, version = [], [], 0
    for i in range(args.warmup + args.updates):
        for mode in modes if i % 2 == 0 else modes[::-1]:
            version += 1
            with torch.no_grad():  # new weights every update, so a missed copy shows up
                for p in params.values():
                    p.add_(2.0**-10)
            rec = sync.update(version, mode=mode)
            bad += [f"v{version} {mode}: {b}" for b in sync.verify()]
            if i >= args.warmup:
                rows.append({"mode": mode, "phases": rec.phases, "busiest": rec.busiest_link_bytes,
                             "bytes": sum(rec.link_bytes.values()), "buckets": rec.buckets,
                             "buffer_bytes": rec.buffer_bytes})
    fallback = sync.fallback_reason
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"rows": rows, "bad": bad[:10], "fallback": fallback}))


def _collect(procs: list, out, timeout_s: float) -> dict:
    res: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(res) < len(procs):
        try:
            rank, r = out.get(timeout=5)
            res[rank] = r
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError("a trainer rank failed; see its output above") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainer ranks did not finish in {timeout_s}s") from None
    for p in procs:
        p.join(60)
    return res


def bench_case(name: str, case: Case, args: argparse.Namespace, tmp: Path) -> dict:
    model = _model_arg(case, tmp)
    t0 = time.perf_counter()
    engines = start_engines(DemoConfig(model=model, engine_tp=case.engines, timeout_s=300))
    procs: list = []
    try:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        port, world = _free_port(), case.tp * case.pp
        procs = [ctx.Process(target=_trainer, args=(r, port, [u for _, u in engines], case, model, args, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        res = _collect(procs, out, timeout_s=900)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for proc, _ in engines:
            proc.terminate()
        for proc, _ in engines:
            proc.wait(30)
    summary = {"topology": name, "case": asdict(case), "trainer_ranks": case.tp * case.pp,
               "engine_ranks": sum(case.engines), "wall_s": time.perf_counter() - t0,
               "checksum_ok": not any(r["bad"] for r in res.values()),
               "mismatches": [b for r in res.values() for b in r["bad"]],
               "fallback": res[0]["fallback"], "modes": {}, "records": res[0]["rows"]}
    for mode in MODES:
        rows = [r for r in res[0]["rows"] if r["mode"] == mode]
        if not rows:
            continue
        summary["modes"][mode] = {
            "median_s": statistics.median(r["phases"]["total"] for r in rows), "n": len(rows),
            "phases_median_s": {k: statistics.median(r["phases"][k] for r in rows)
                                for k in ("pack", "transfer", "unpack", "control")},
            "busiest_link_bytes": rows[0]["busiest"], "bytes": rows[0]["bytes"],
            "buckets": rows[0]["buckets"],
        }
    m = summary["modes"]
    if len(m) == 2:
        summary["ratio_p2p_over_broadcast"] = m["p2p"]["median_s"] / m["broadcast"]["median_s"]
    return summary


def table(results: list[dict]) -> list[str]:
    lines = ["| topology | ranks (trainer+engine) | p2p median ms | broadcast median ms | ratio "
             "| p2p busiest link KiB | broadcast busiest link KiB | checksum ok |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["modes"]

        def cell(mode: str, key: str, scale: float, fmt: str, m=m) -> str:
            return format(m[mode][key] * scale, fmt) if mode in m else "n/a"

        ratio = format(r["ratio_p2p_over_broadcast"], ".2f") if "ratio_p2p_over_broadcast" in r else "n/a"
        lines.append(
            f"| {r['topology']} | {r['trainer_ranks']}+{r['engine_ranks']} "
            f"| {cell('p2p', 'median_s', 1e3, '.1f')} | {cell('broadcast', 'median_s', 1e3, '.1f')} "
            f"| {ratio} | {cell('p2p', 'busiest_link_bytes', 1 / 1024, '.0f')} "
            f"| {cell('broadcast', 'busiest_link_bytes', 1 / 1024, '.0f')} "
            f"| {'yes' if r['checksum_ok'] else 'NO'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", choices=list(CASES), help="topology (repeatable)")
    ap.add_argument("--updates", type=int, default=5, help="measured updates per mode")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds (one update per mode)")
    ap.add_argument("--bucket-mb", type=float, default=1.0)
    ap.add_argument("--credits", type=int, default=2)
    ap.add_argument("--out", default="topologies.json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or list(CASES):
            r = bench_case(name, CASES[name], args, Path(tmp))
            print(f"{name}: {r['wall_s']:.1f}s wall", flush=True)
            results.append(r)
    print(f"bucket {args.bucket_mb:g} MiB, credits {args.credits}, {args.updates} measured updates "
          f"per mode after {args.warmup} warmup round(s), alternating; {time.perf_counter() - t0:.0f}s total")
    for line in table(results):
        print(line)
    for r in results:
        if r["fallback"]:
            print(f"{r['topology']}: mode=auto fell back: {r['fallback']}")
        for b in r["mismatches"]:
            print(f"{r['topology']}: checksum mismatch {b}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus, gloo",
                   "torch": torch.__version__, "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
