"""Line up a hop trace (``sitecustomize.py``) per update: for every hop, the median time of
its first entry and exit after the trainer's ``update()`` was called, with the thread.

    python benchmarks/hop_trace/analyze.py /tmp/hops [--skip 2] [--out hops.json]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--skip", type=int, default=2, help="updates left out at the start (connect, warm-up)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    events = []
    for path in glob.glob(os.path.join(args.folder, "*.jsonl")):
        with open(path) as f:
            events += [tuple(json.loads(line)) for line in f]
    events.sort(key=lambda e: e[2])
    starts = [t for label, side, t, _ in events if label == "WeightSync.update" and side == "in"]
    times: dict[str, list[float]] = defaultdict(list)
    for begin, end in zip(starts[args.skip:], starts[args.skip + 1:], strict=False):
        seen: dict[str, float] = {}
        for label, side, t, thread in events:
            if begin <= t < end:
                seen.setdefault(f"{label} {side} [{thread}]", (t - begin) / 1e3)
        for key, us in seen.items():
            times[key].append(us)
    rows = sorted((statistics.median(v), k, len(v)) for k, v in times.items())
    print(f"{'us after update()':>18}  hop (median of {max((n for *_, n in rows), default=0)} updates)")
    for us, key, n in rows:
        print(f"{us:18.1f}  {key}" + ("" if n == len(starts[args.skip + 1:]) else f"  (in {n})"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{"hop": k, "median_us": us, "updates": n} for us, k, n in rows], f, indent=1)


if __name__ == "__main__":
    main()
