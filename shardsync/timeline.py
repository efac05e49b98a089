"""One update drawn on one wall clock: every trainer rank's buckets (pack, transfer, unpack)
and each engine's receive, commit and pause, from the ranks' records (``SyncConfig(detail=True,
records_path="records-{rank}.jsonl")``), as a Chrome trace (``chrome://tracing``, Perfetto)
and a PNG, so the pipeline and its stragglers are seen rather than summed.

Engines report durations, not times: their bars end where trainer rank 0's update ended.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PHASES = ("pack", "transfer", "unpack", "receive", "commit", "pause")
COLORS = {"pack": "#4C72B0", "transfer": "#DD8452", "unpack": "#55A868", "receive": "#8172B3", "commit": "#937860",
          "pause": "#C44E52"}


@dataclass(frozen=True)
class Span:
    row: str  # who: "trainer rank 1", "engine 0"
    lane: int  # rows split into lanes where spans overlap (transfers in flight)
    phase: str
    label: str  # the bucket, or what an engine did
    start: float  # seconds since the update began
    end: float


def load(paths: Iterable[str | Path], version: int | None = None) -> list[dict]:
    """Every rank's record of update ``version`` (None: the newest all files hold with bucket
    times: delta updates carry none), by rank; of several updates with one version (a demo step
    by two paths), the last."""
    by_rank: dict[int, dict[int, dict]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                by_rank.setdefault(rec["rank"], {})[rec["version"]] = rec
    if not by_rank:
        raise ValueError("no update records in the files given")
    common = set.intersection(*(set(v) for v in by_rank.values()))
    timed = {v for v in common if all(recs[v]["steps"] for recs in by_rank.values())}
    pick = version if version is not None else max(timed or common, default=None)
    if pick is None or pick not in common:
        raise ValueError(f"no update {pick} in every rank's records (all of them hold {sorted(common)})")
    return [by_rank[r][pick] for r in sorted(by_rank)]


def _lanes(spans: list[tuple[str, str, float, float]], first: int) -> list[tuple[int, str, str, float, float]]:
    """Each span on the first lane (from ``first``) free at its start."""
    ends: list[float] = []
    out = []
    for phase, label, start, end in sorted(spans, key=lambda s: s[2]):
        lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
        if lane == len(ends):
            ends.append(end)
        ends[lane] = end
        out.append((first + lane, phase, label, start, end))
    return out


def spans(records: Sequence[dict]) -> list[Span]:
    """The spans of one update's records (``load``): lane 0 of a trainer rank is its own work
    (pack, unpack), the lanes after it the transfers in flight."""
    lead = next((r for r in records if r["rank"] == 0), records[0])
    t0 = lead["started_at"]  # rank 0 decides when an update begins (the others wait for its word)
    out: list[Span] = []
    for r in records:
        steps = [s for s in r["steps"] if s.get("start")]
        if r["steps"] and not steps or not r["started_at"]:
            raise ValueError(f"trainer rank {r['rank']}'s record has no times: it predates them")
        row = f"trainer rank {r['rank']}"
        for s in steps:
            out.append(Span(row, 0, "pack", s["label"], s["start"] - t0, s["posted"] - t0))
            out.append(Span(row, 0, "unpack", s["label"], s["landed"] - t0, s["done"] - t0))
        flying = [("transfer", s["label"], s["posted"] - t0, s["landed"] - t0) for s in steps]
        out += [Span(row, lane, phase, label, a, b) for lane, phase, label, a, b in _lanes(flying, 1)]
    if not any(r["steps"] for r in records):
        raise ValueError("the records hold no bucket times: run with SyncConfig(detail=True)")
    end = lead["phases"]["total"]
    for i, e in enumerate(lead["engines"]):
        out.append(Span(f"engine {i} receive", 0, "receive", "receive (slowest rank)", end - e["total_s"], end))
        if e.get("commit_s"):  # a staged engine's swap (or copy) into the served weights
            out.append(Span(f"engine {i} commit", 0, "commit", "commit", end - e["commit_s"], end))
        out.append(Span(f"engine {i} pause", 0, "pause", "not generating", end - e["pause_s"], end))
    return out


def chrome_trace(items: Sequence[Span], *, version: int) -> dict:
    """The Trace Event Format: one process per row, one thread per lane, times in µs."""
    rows = list(dict.fromkeys(s.row for s in items))
    events: list[dict] = [{"name": "process_name", "ph": "M", "pid": i, "args": {"name": row}}
                          for i, row in enumerate(rows)]
    events += [{"name": f"{s.phase} {s.label}", "cat": s.phase, "ph": "X", "pid": rows.index(s.row), "tid": s.lane,
                "ts": round(s.start * 1e6, 3), "dur": round(max(s.end - s.start, 0.0) * 1e6, 3)} for s in items]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"update": version}}


def draw(items: Sequence[Span], path: str | Path, *, title: str) -> None:
    """A Gantt chart of ``items`` as a PNG (one band per row and lane)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    bands = list(dict.fromkeys((s.row, s.lane) for s in items))
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(bands) + 1.6))
    for s in items:
        y = len(bands) - 1 - bands.index((s.row, s.lane))
        ax.broken_barh([(s.start * 1e3, max(s.end - s.start, 0.0) * 1e3)], (y - 0.4, 0.8),
                       facecolors=COLORS[s.phase], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(bands)))
    ax.set_yticklabels([f"{row}" if lane == 0 else f"{row} (in flight {lane})" for row, lane in reversed(bands)],
                       fontsize=8)
    ax.set_xlabel("ms since the update began")
    ax.set_title(title, fontsize=10)
    ax.legend(handles=[Patch(color=COLORS[p], label=p) for p in PHASES if any(s.phase == p for s in items)],
              loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=len(PHASES), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render(paths: Iterable[str | Path], *, version: int | None = None, png: str | Path | None = None,
           trace: str | Path | None = None) -> list[Span]:
    """``load`` -> ``spans`` -> the PNG and the trace JSON (each where a path is given)."""
    records = load(paths, version)
    items = spans(records)
    v = records[0]["version"]
    if trace is not None:
        Path(trace).write_text(json.dumps(chrome_trace(items, version=v)))
    if png is not None:
        lead = records[0]
        draw(items, png, title=f"update {v}: {lead['mode']}, {len(records)} trainer rank(s), "
                                f"{len(lead['engines'])} engine(s), {lead['phases']['total'] * 1e3:.1f} ms")
    return items
