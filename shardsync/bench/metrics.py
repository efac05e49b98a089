"""Metrics from measured per-transfer timestamps (pure).

Input, per measured iteration and rank: ``t0`` (the rank's clock right after the
iteration's world barrier), its transfers as ``(group, kind, nbytes, t_post, t_end,
synced)`` rows, and its phase times.  A rank's latency is measured on its own clock
(last completion minus its ``t0``); cross-rank quantities (engine groups active at once)
compare raw clocks when every rank shares one host clock, else ``t0``-aligned ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

QUANTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0}
RECEIVED = ("recv", "bcast")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float]:
    out = {k: percentile(values, q) for k, q in QUANTILES.items()}
    out["max"] = max(values)
    return out


def skew(values: Iterable[float]) -> float:
    """Spread between the first and the last rank to finish."""
    vs = list(values)
    return max(vs) - min(vs) if vs else 0.0


def max_overlap(intervals: Iterable[tuple[float, float, float]]) -> float:
    """Largest total weight of half-open intervals ``[start, end)`` open at one instant."""
    events = []
    for start, end, w in intervals:
        if end < start:
            raise ValueError(f"interval ends before it starts: {start} > {end}")
        if end > start:
            events.append((start, 1, w))
            events.append((end, 0, -w))
    events.sort(key=lambda e: (e[0], e[1]))  # an interval ending at t closes before one opening at t
    best = cur = 0.0
    for _, _, w in events:
        cur += w
        best = max(best, cur)
    return best


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def iteration_metrics(ranks: Mapping[int, Mapping], *, shared_clock: bool) -> dict:
    """One iteration: ``ranks[r] = {"t0", "transfers", "phases"}`` -> latency, skew, idle, peaks."""
    lat: dict[int, float] = {}
    for r, it in ranks.items():
        ends = [t[4] for t in it["transfers"]]
        if ends:
            lat[r] = max(ends) - it["t0"]
    slowest = max(lat.values(), default=0.0)
    idle, inflight, delivered = {}, {}, 0
    spans: dict[int, list[float]] = {}
    for r, it in ranks.items():
        t0, rows = it["t0"], it["transfers"]
        inflight[r] = max_overlap((t[3], t[4], t[2]) for t in rows)
        busy = union_length((min(max(t[3] - t0, 0.0), slowest), min(t[4] - t0, slowest)) for t in rows)
        idle[r] = slowest - busy
        delivered += sum(t[2] for t in rows if t[1] in RECEIVED)
        shift = 0.0 if shared_clock else t0
        for t in rows:
            s = spans.setdefault(t[0], [math.inf, -math.inf])
            s[0], s[1] = min(s[0], t[3] - shift), max(s[1], t[4] - shift)
    phases = {k: max(it["phases"].get(k, 0.0) for it in ranks.values())
              for k in sorted({k for it in ranks.values() for k in it["phases"]})}
    share = sum(idle.values()) / len(idle) / slowest if idle and slowest > 0 else 0.0
    return {"latency_s": slowest, "rank_latency_s": lat, "skew_s": skew(lat.values()),
            "idle_s": idle, "idle_fraction": share, "max_inflight_bytes": inflight,
            "delivered_bytes": delivered,
            "group_spans": {g: tuple(s) for g, s in spans.items()},
            # an engine receiving in place serves nothing from its group's first transfer to its
            # last (docs/serving.md; a staged engine pauses only to commit)
            "engine_pause_s": max((e - s for s, e in spans.values()), default=0.0),
            "active_groups": int(max_overlap((s, e, 1) for s, e in spans.values())),
            "phases_s": phases}


def aggregate(iterations: Sequence[Mapping]) -> dict:
    """A configuration's metrics over its measured iterations."""
    if not iterations:
        raise ValueError("no measured iterations to aggregate")
    lat = [it["latency_s"] for it in iterations]
    ranks = sorted({r for it in iterations for r in it["idle_s"]})
    idle = {r: sum(it["idle_s"][r] for it in iterations) / len(iterations) for r in ranks}
    inflight = {r: max(it["max_inflight_bytes"][r] for it in iterations) for r in ranks}
    delivered = iterations[0]["delivered_bytes"]
    if any(it["delivered_bytes"] != delivered for it in iterations):
        raise ValueError("iterations delivered different byte counts")
    p50 = percentile(lat, 50)
    phase_keys = sorted({k for it in iterations for k in it["phases_s"]})
    return {
        "latency_s": summary(lat),
        "skew_s": summary([it["skew_s"] for it in iterations]),
        "engine_pause_s": summary([it.get("engine_pause_s", 0.0) for it in iterations]),
        "idle_s": idle,
        "idle_fraction": percentile([it["idle_fraction"] for it in iterations], 50),
        "max_inflight_bytes": inflight,
        "max_inflight_bytes_any_rank": max(inflight.values(), default=0),
        "max_active_groups": max(it["active_groups"] for it in iterations),
        "delivered_bytes": delivered,
        "gb_per_s": delivered / p50 / 1e9 if p50 > 0 else 0.0,
        "phases_s": {k: percentile([it["phases_s"].get(k, 0.0) for it in iterations], 50)
                     for k in phase_keys},
        "iterations": len(iterations),
    }
