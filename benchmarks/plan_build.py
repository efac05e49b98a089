"""What one process pays at connect for large topologies (metadata only): both layouts, the
p2p plan and its fingerprint, the broadcast plan and its fingerprint (connect compares both),
and its own links' buckets (trainer rank 0's, engine rank 0's).  Apart, not in the total: every
copy of the p2p plan and all its buckets, what ``shardsync plan`` makes.

    python benchmarks/plan_build.py [--repeat 3] [--out plan_build.json] [--models Kimi-K2 ...]
        [--engine-quantization fp8]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.layout.logical import logical_tensors, model_tensors
from shardsync.plan import make_buckets
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.views import views_of

BUCKET = 512 * 2**20

CASES = [
    ("Llama-3.1-70B", MegatronParallel(tp=8, pp=4, dp=2), (EngineParallel(tp=8),) * 8),
    ("Llama-3.1-70B", MegatronParallel(tp=8), (EngineParallel(tp=4),)),
    ("Qwen3-4B", MegatronParallel(tp=4), (EngineParallel(tp=4),)),
    ("Qwen3-32B", MegatronParallel(tp=8, pp=2), (EngineParallel(tp=4), EngineParallel(tp=2))),
    # mixture of experts (issue: plan in under 2 s)
    ("Qwen3-30B-A3B", MegatronParallel(tp=2, dp=4, ep=4), (EngineParallel(tp=4),)),
    ("Qwen3-235B-A22B", MegatronParallel(tp=4, pp=4, dp=2, ep=8, etp=1, pp_layers=(24, 24, 24, 22)),
     (EngineParallel(tp=8, ep=8),) * 2),
    # one node, published 2.51 s NCCL / 4.23 s RDMA
    ("GLM-4.7-Flash", MegatronParallel(tp=4, dp=2, ep=8, etp=1), (EngineParallel(tp=4, ep=4),) * 2),
    # NeMo-RL: PP16 x EP16 -> TP32 x DP8
    ("DeepSeek-V3", MegatronParallel(tp=1, pp=16, dp=16, ep=16, etp=1, pp_layers=(4,) * 15 + (1,)),
     (EngineParallel(tp=32, ep=32),) * 8),
    # the P2P examples' 64-node run: 32 trainer + 32 rollout nodes
    ("Kimi-K2", MegatronParallel(tp=8, pp=4, dp=8, ep=32, etp=1, pp_layers=(16, 15, 15, 15)),
     (EngineParallel(tp=16, ep=16),) * 16),
    # sparse attention: the examples' GLM-5 run (16 + 16 nodes; published 58.3 s broadcast, 8.48 s per-shard)
    ("GLM-5", MegatronParallel(tp=4, pp=4, dp=8, ep=32, etp=1, pp_layers=(20, 20, 20, 18)),
     (EngineParallel(tp=8, ep=8),) * 16),
    ("DeepSeek-V3.2", MegatronParallel(tp=1, pp=16, dp=16, ep=16, etp=1, pp_layers=(4,) * 15 + (1,)),
     (EngineParallel(tp=32, ep=32),) * 8),
    # gated DeltaNet hybrid on one node
    ("Qwen3-Next-80B-A3B", MegatronParallel(tp=2, dp=4, ep=8, etp=1), (EngineParallel(tp=4, ep=4),) * 2),
]


def run_case(model: str, trainer: MegatronParallel, engines: tuple[EngineParallel, ...],
             quantization: str | None = None) -> dict:
    # Start from a collected heap: the previous run's million copies otherwise promote through
    # the collector's generations and a full pass (~1 s for a 1T plan) lands in a random phase.
    gc.collect()
    logical_tensors.cache_clear()  # each run makes the spec's tensor list again
    model_tensors.cache_clear()
    t0 = time.perf_counter()
    topo = Topology(PRESETS[model], trainer, engines, views=views_of(quantization))
    _ = (topo.trainer_layout, topo.engines_layout)  # build both layouts inside the timer
    t1 = time.perf_counter()
    plan = topo.p2p_plan
    t2 = time.perf_counter()
    fp = plan.fingerprint
    t3 = time.perf_counter()
    _ = topo.broadcast_plan.fingerprint
    t4 = time.perf_counter()
    sent, got = plan.copies_from(0), plan.copies_to(0)
    rank_buckets = len(make_buckets(plan, BUCKET, sent)) + len(make_buckets(plan, BUCKET, got))
    t5 = time.perf_counter()
    buckets = make_buckets(plan, BUCKET)
    t6 = time.perf_counter()
    return {
        "model": model, "trainer": f"TP{trainer.tp} PP{trainer.pp} DP{trainer.dp}"
        + (f" EP{trainer.ep}" if trainer.ep > 1 else ""),
        "engines": (f"{len(engines)} x TP{engines[0].tp}" if len(set(engines)) == 1
                    else "+".join(f"TP{e.tp}" for e in engines)) + (f" EP{engines[0].ep}" if engines[0].ep > 1 else ""),
        "layouts_s": t1 - t0, "plan_s": t2 - t1, "fingerprint_s": t3 - t2, "broadcast_s": t4 - t3,
        "rank_buckets_s": t5 - t4, "total_s": t5 - t0, "all_copies_s": t6 - t5,
        "copies": len(plan.copies), "rank_copies": len(sent) + len(got), "rank_buckets": rank_buckets,
        "buckets": len(buckets), "fingerprint": fp,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3, help="runs per case; the median is reported")
    ap.add_argument("--out", default="plan_build.json")
    ap.add_argument("--models", nargs="+", metavar="MODEL",
                    help="run only these models' cases (a quick run skips the 1T ones)")
    ap.add_argument("--engine-quantization", default=None,
                    help="engines serve FP8 in this format (e.g. fp8): the trainer sends e4m3 words and scales")
    args = ap.parse_args()
    rows = []
    for model, trainer, engines in CASES:
        if args.models and model not in args.models:
            continue
        runs = sorted((run_case(model, trainer, engines, args.engine_quantization) for _ in range(args.repeat)),
                      key=lambda r: r["total_s"])
        rows.append(runs[len(runs) // 2])
    print(f"{'model':<15} {'trainer':<18} {'engines':<15} {'layouts':>8} {'plan':>7} {'fprint':>7} "
          f"{'bcast':>7} {'rank bk':>8} {'total s':>8} {'copies':>8} {'rank':>6}   {'all copies s':>12}")
    for r in rows:
        print(f"{r['model']:<15} {r['trainer']:<18} {r['engines']:<15} {r['layouts_s']:>8.3f} "
              f"{r['plan_s']:>7.3f} {r['fingerprint_s']:>7.3f} {r['broadcast_s']:>7.3f} {r['rank_buckets_s']:>8.3f} "
              f"{r['total_s']:>8.3f} {r['copies']:>8} {r['rank_copies']:>6}   {r['all_copies_s']:>12.3f}")
    with open(args.out, "w") as f:
        json.dump({"machine": platform.platform(), "processor": platform.processor(),
                   "repeat": args.repeat, "engine_quantization": args.engine_quantization, "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
