"""How much of an FP8 engine's weights a GRPO step changes: the demo's training steps (the
reference trainer, RL-typical learning rate) synced by delta into reference engines serving
FP8, per update the model-dtype elements the delta moved and the e4m3 bytes and scales the
engine's quantization changed (``derived_changed``), each over its total (the first update
is a full one: the engines start from the trainer's initial weights, rounded to bf16).  The gap between
the two says what a delta of the quantized bytes would move instead of the wide ones.

    python benchmarks/fp8_delta.py --model tiny-qwen3-fp8 --steps 5 [--lr 1e-5] [--out fp8_delta.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
from pathlib import Path

from shardsync.demo.run import DemoConfig, run_demo
from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.logical import model_tensors
from shardsync.presets import load_spec
from shardsync.quant import fp8_format, quantized


def _fp8_elements(model: str, tp: int, ep: int, fmt: str) -> int:
    """e4m3 elements and scales the engine holds, over all its ranks."""
    spec = load_spec(model)
    lay = engine_layout(spec, EngineParallel(tp=tp, ep=ep, dtype=spec.dtype))
    total = 0
    for rank in lay.ranks:
        for t in quantized(rank, spec, fp8_format(fmt)).values():
            total += math.prod(t.shape) + math.prod(t.scale_shape)
    return total


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
    spec = load_spec(args.model)
    wide = sum(math.prod(s) for s in model_tensors(spec).values())
    fp8 = _fp8_elements(args.model, args.engine_tp, args.engine_ep, args.format)
    rows = []
    for r in records:
        delta = r.get("delta") or {}
        derived = sum(e["derived_changed"] for e in r["engines"])
        rows.append({"version": r["version"], "wide_changed": delta.get("engine_changed", 0), "wide_total": wide,
                     "fp8_changed": derived, "fp8_total": fp8})
    print(f"{args.model}: {args.steps} GRPO steps at lr {args.lr}, delta sync into engines TP{args.engine_tp} "
          f"EP{args.engine_ep} serving {args.format}")
    print(f"{'version':>7} {'wide changed':>13} {'of':>10} {'density':>8} "
          f"{'fp8 changed':>12} {'of':>10} {'density':>8}")
    for row in rows:
        print(f"{row['version']:>7} {row['wide_changed']:>13} {row['wide_total']:>10} "
              f"{row['wide_changed'] / row['wide_total']:>8.4f} {row['fp8_changed']:>12} {row['fp8_total']:>10} "
              f"{row['fp8_changed'] / row['fp8_total']:>8.4f}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
