"""The bench report: JSON, a stdout table, and PNG plots (rank 0 only)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from shardsync.bench.provenance import Provenance, check
from shardsync.bench.sweep import BenchConfig, MiB
from shardsync.bench.topology import BenchLayout

REPORT_VERSION = 1


def build(cfg: BenchConfig, layout: BenchLayout, results: list[dict], env: dict) -> dict:
    """The report; raises ``ProvenanceError`` if any result's timings cannot be proven."""
    for r in results:
        fields: dict[str, Any] = {k: tuple(v) if k == "sync_points" else v for k, v in r["provenance"].items()}
        check(Provenance(**fields), r["label"])
        if r["metrics"] is None:
            raise ValueError(f"{r['label']}: no metrics")
    return {"version": REPORT_VERSION, "config": asdict(cfg), "layout": layout.describe(),
            "environment": env, "results": results}


def write_json(rep: dict, path: str | Path, *, with_traces: bool) -> None:
    out = dict(rep)
    if not with_traces:
        out["results"] = [{k: v for k, v in r.items() if k != "traces"} for r in rep["results"]]
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(out, indent=1))


def _policy(r: dict) -> str:
    p = r["point"]
    return f"windowed(W={p['window']})" if p["policy"] == "windowed" else p["policy"]


def _credits(r: dict) -> str:
    asked, used = r["point"]["credits"], r["effective_credits"]
    return f"{asked}" if asked == used else f"{asked}->{used}"


def _cap(r: dict) -> str:
    cap = r["point"]["inflight_cap_bytes"]
    return "-" if cap is None else f"{cap / MiB:g}"


COLUMNS = (("transport", 9), ("MiB", 6), ("credits", 7), ("cap MiB", 7), ("policy", 14), ("stride us", 9),
           ("reuse", 5),
           ("p50 ms", 8), ("p90", 8), ("p99", 8), ("max", 8), ("skew ms", 8), ("idle%", 6),
           ("GB/s", 7), ("pause ms", 8), ("inflight MiB", 13), ("groups", 7))


def table(rep: dict) -> str:
    """One row per configuration: slowest-rank latency, skew, idle, GB/s, observed vs bound."""
    lay = rep["layout"]
    env = rep["environment"]
    lines = [f"shardsync bench: world {lay['world_size']} ({env['backend']}, {env['device']}), "
             f"trainer ranks {lay['trainers']}, engine groups {lay['engine_groups']}; "
             f"{rep['config']['iters']} measured + {rep['config']['warmup']} warm-up iterations",
             " ".join(f"{name:>{w}}" for name, w in COLUMNS)]
    for r in rep["results"]:
        m, p = r["metrics"], r["point"]
        lat = m["latency_s"]
        cells = (p["transport"], f"{p['bucket_bytes'] / MiB:g}", _credits(r), _cap(r), _policy(r),
                 f"{p['stride_s'] * 1e6:g}", "on" if p["reuse"] else "off",
                 *(f"{lat[k] * 1e3:.2f}" for k in ("p50", "p90", "p99", "max")),
                 f"{m['skew_s']['p50'] * 1e3:.2f}", f"{m['idle_fraction'] * 100:.0f}", f"{m['gb_per_s']:.2f}",
                 f"{m.get('engine_pause_s', {}).get('p50', 0.0) * 1e3:.2f}",
                 f"{m['max_inflight_bytes_any_rank'] / MiB:.2f}/{r['inflight_bound_bytes'] / MiB:.2f}",
                 f"{m['max_active_groups']}/{r['bound_groups']}")
        lines.append(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, COLUMNS, strict=True)))
    lines.append("latency: slowest rank, last completion after the iteration barrier; skew: spread of "
                 "rank finish times; idle%: mean share of an iteration a rank has nothing in flight (p50); "
                 "GB/s: bytes landed on engine ranks / p50; pause: p50 of the longest engine group's first-to-last "
                 "transfer (what an engine receiving in place stops generating for); "
                 "credits: asked->used under the cap; "
                 "inflight: observed max per rank / bound; "
                 "groups: observed max active engine groups / policy bound")
    return "\n".join(lines)


def _fixed(rep: dict) -> dict:
    """The first value of every axis the latency plot does not show."""
    c = rep["config"]
    cap = c["inflight_mb"][0]
    return {"credits": c["credits"][0], "inflight_cap_bytes": None if cap is None else int(cap * MiB),
            "stride_s": c["stride_us"][0] * 1e-6, "reuse": c["reuse"][0]}


def plot(rep: dict, out_dir: str | Path) -> list[Path]:
    """``latency.png`` (p50 by policy and size, p90 whisker) and ``inflight.png`` (from traces)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fixed = _fixed(rep)
    rows = [r for r in rep["results"] if all(r["point"][k] == v for k, v in fixed.items())]
    transports = list(dict.fromkeys(r["point"]["transport"] for r in rows))
    sizes = sorted({r["point"]["bucket_bytes"] for r in rows})
    policies = list(dict.fromkeys(_policy(r) for r in rows))
    fig, axes = plt.subplots(1, len(transports), figsize=(4.2 * len(transports), 3.4), squeeze=False)
    width = 0.8 / max(1, len(policies))
    for ax, t in zip(axes[0], transports, strict=True):
        for j, pol in enumerate(policies):
            pts = {r["point"]["bucket_bytes"]: r["metrics"]["latency_s"] for r in rows
                   if r["point"]["transport"] == t and _policy(r) == pol}
            xs = [i + (j - (len(policies) - 1) / 2) * width for i, s in enumerate(sizes) if s in pts]
            p50 = [pts[s]["p50"] * 1e3 for s in sizes if s in pts]
            p90 = [(pts[s]["p90"] - pts[s]["p50"]) * 1e3 for s in sizes if s in pts]
            ax.bar(xs, p50, width, yerr=[[0] * len(p90), p90], capsize=2, label=pol)
        ax.set_xticks(range(len(sizes)), [f"{s / MiB:g}" for s in sizes])
        ax.set_xlabel("message / bucket MiB")
        ax.set_ylabel("slowest-rank latency p50 ms (whisker p90)")
        ax.set_title(t)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"credits {fixed['credits']}, stride {fixed['stride_s'] * 1e6:g} us, "
                 f"reuse {'on' if fixed['reuse'] else 'off'}", fontsize=9)
    fig.tight_layout()
    lat_path = out / "latency.png"
    fig.savefig(lat_path, dpi=80)
    plt.close(fig)
    return [lat_path, plot_inflight(rep, out / "inflight.png")]


def _median_trace(traces: list[dict]) -> dict[int, dict]:
    """The measured iteration whose slowest-rank latency is the median (a typical one)."""
    def latency(tr: dict) -> float:
        return max((max(t[4] for t in v["transfers"]) - v["t0"] for v in tr.values() if v["transfers"]),
                   default=0.0)

    ranked = sorted(traces, key=latency)
    return {int(k): v for k, v in ranked[(len(ranked) - 1) // 2].items()}


def plot_inflight(rep: dict, path: Path) -> Path:
    """Bytes in flight at the trainer ranks and each engine group's active span, per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fixed = _fixed(rep)
    first = rep["results"][0]["point"]
    fixed |= {"transport": first["transport"], "bucket_bytes": first["bucket_bytes"]}
    rows = [r for r in rep["results"] if r.get("traces") and all(r["point"][k] == v for k, v in fixed.items())]
    trainers = set(rep["layout"]["trainers"])
    fig, axes = plt.subplots(len(rows), 1, figsize=(7, 1.6 * len(rows) + 0.6), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, r in zip(axes[:, 0], rows, strict=True):
        trace = _median_trace(r["traces"])
        origin = min(v["t0"] for v in trace.values())
        events = []
        spans: dict[int, list[float]] = {}
        for rank, v in trace.items():
            for g, _, n, ts, te, _ in v["transfers"]:
                if rank in trainers:
                    events += [(ts, n), (te, -n)]
                s = spans.setdefault(g, [ts, te])
                s[0], s[1] = min(s[0], ts), max(s[1], te)
        for g, (start, end) in sorted(spans.items()):
            ax.axvspan((start - origin) * 1e3, (end - origin) * 1e3, ymin=0.0, ymax=1.0, alpha=0.18,
                       color=colors[g % len(colors)], label=f"group {g} active")
        xs, ys, cur = [0.0], [0.0], 0
        for t, d in sorted(events, key=lambda e: (e[0], e[1])):
            xs.append((t - origin) * 1e3)
            ys.append(cur / MiB)
            cur += d
            xs.append((t - origin) * 1e3)
            ys.append(cur / MiB)
        ax.plot(xs, ys, color="black", lw=1)
        ax.set_ylabel("MiB in flight", fontsize=7)
        ax.set_title(f"{_policy(r)}: {r['metrics']['max_active_groups']} group(s) at once "
                     f"(bound {r['bound_groups']})", fontsize=8)
        ax.legend(fontsize=6, loc="upper right")
    axes[-1, 0].set_xlabel(f"ms since the iteration barrier (median iteration; {first['transport']}, "
                           f"{first['bucket_bytes'] / MiB:g} MiB, credits {fixed['credits']})")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
