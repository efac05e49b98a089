"""How much of an FP8 engine's weights a GRPO step changes, and what a delta moves for it: the
demo's training steps (the reference trainer, RL-typical learning rate) synced by delta into
reference engines serving FP8.  The trainer sends the e4m3 bytes and scales it quantized
(``quant.wire``), so a delta XORs those: per update, the FP8 bytes and scales trainer rank 0's
quantization changed (``quantized_changed``) over all it holds, and the bytes the engines
received against the first (full) update's.

    python benchmarks/fp8_delta.py --model tiny-qwen3-fp8 --steps 5 [--lr 1e-5] [--out fp8_delta.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from pathlib import Path

from shardsync.demo.run import DemoConfig, run_demo
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.presets import load_spec
from shardsync.quant.wire import PER_WORD
from shardsync.topology import Topology
from shardsync.views import views_of


def _fp8_elements(model: str, trainer_tp: int, tp: int, ep: int, fmt: str) -> int:
    """e4m3 bytes and scales trainer rank 0 quantizes (its regions of the weights sent quantized)."""
    spec = load_spec(model)
    topo = Topology(spec, MegatronParallel(tp=trainer_tp), (EngineParallel(tp=tp, ep=ep, dtype=spec.dtype),),
                    views=views_of(fmt))
    lay = topo.trainer_layout.ranks[0]
    return sum(lay.tensor(d.words).numel * PER_WORD + lay.tensor(d.scales).numel for d in topo.derived(0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3-fp8")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-5, help="the trainer's learning rate (RL-typical: 1e-6..1e-5)")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--engine-ep", type=int, default=1)
    ap.add_argument("--format", default="fp8")
    ap.add_argument("--out", default="fp8_delta.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DemoConfig(model=args.model, trainer_tp=args.trainer_tp, engine_tp=(args.engine_tp,),
                         engine_ep=args.engine_ep, steps=args.steps, mode="delta", lr=args.lr, out=tmp,
                         engine_quantization=args.format, engine_dtype="bfloat16")
        if run_demo(cfg) != 0:
            raise SystemExit("the demo failed")
        records = [json.loads(line) for line in (Path(tmp) / "records.jsonl").read_text().splitlines()]
    fp8 = _fp8_elements(args.model, args.trainer_tp, args.engine_tp, args.engine_ep, args.format)
    full = sum(e["bytes_received"] for e in records[0]["engines"])
    rows = []
    for r in records:
        received = sum(e["bytes_received"] for e in r["engines"])
        rows.append({"version": r["version"], "mode": r["mode"], "fp8_changed": r["quantized_changed"],
                     "fp8_total": fp8, "bytes_received": received, "full_bytes": full})
    print(f"{args.model}: {args.steps} GRPO steps at lr {args.lr}, trainer TP{args.trainer_tp} -> delta sync into "
          f"engines TP{args.engine_tp} EP{args.engine_ep} serving {args.format}")
    print(f"{'version':>7} {'mode':>10} {'fp8 changed (rank 0)':>21} {'of':>10} {'density':>8} "
          f"{'engine bytes':>13} {'of full':>8}")
    for row in rows:
        print(f"{row['version']:>7} {row['mode']:>10} {row['fp8_changed']:>21} {row['fp8_total']:>10} "
              f"{row['fp8_changed'] / row['fp8_total']:>8.4f} {row['bytes_received']:>13} "
              f"{row['bytes_received'] / max(1, full):>8.3f}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
