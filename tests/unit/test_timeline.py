"""One update on one clock (``timeline.py``): records of two ranks become spans whose lanes
never overlap, a Chrome trace with one process per row, and a PNG; records without bucket
times are refused with what to do."""

from __future__ import annotations

import json

import pytest

from shardsync import timeline


def _record(rank: int, started: float, steps: list[tuple[float, float, float, float]], version: int = 3) -> dict:
    return {"rank": rank, "version": version, "mode": "p2p", "started_at": started,
            "phases": {"total": 0.010},
            "engines": [{"total_s": 0.006, "pause_s": 0.001, "commit_s": 0.0005}] if rank == 0 else [],
            "steps": [{"label": f"b{i}", "link": "t->e", "bytes": 8, "start": a, "posted": b, "landed": c, "done": d}
                      for i, (a, b, c, d) in enumerate(steps)]}


def _files(tmp_path, *records: dict) -> list:
    paths = []
    for r in records:
        p = tmp_path / f"records-{r['rank']}.jsonl"
        with p.open("a") as f:
            f.write(json.dumps(r) + "\n")
        paths.append(p)
    return sorted(set(paths))


def test_spans_lane_the_transfers_in_flight_and_place_engines_at_the_end(tmp_path) -> None:
    t = 100.0
    r0 = _record(0, t, [(t + .001, t + .002, t + .006, t + .0065), (t + .002, t + .003, t + .005, t + .0055),
                        (t + .005, t + .0055, t + .008, t + .0085)])
    r1 = _record(1, t - 0.5, [(t + .001, t + .0015, t + .004, t + .004)])  # waited for rank 0's word
    items = timeline.spans(timeline.load(_files(tmp_path, r0, r1)))
    wire = [s for s in items if s.row == "trainer rank 0" and s.phase == "transfer"]
    assert len(wire) == 3 and {s.lane for s in wire} == {1, 2}  # two in flight at once, then a lane is free
    for lane in {s.lane for s in wire}:
        mine = sorted((s.start, s.end) for s in wire if s.lane == lane)
        assert all(a[1] <= b[0] for a, b in zip(mine, mine[1:], strict=False))
    assert min(s.start for s in items if s.row.startswith("trainer")) == pytest.approx(0.001)  # rank 0's clock
    pause = next(s for s in items if s.row == "engine 0 pause")
    assert (pause.start, pause.end) == pytest.approx((0.009, 0.010))
    trace = timeline.chrome_trace(items, version=3)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"trainer rank 0", "trainer rank 1", "engine 0 receive", "engine 0 commit", "engine 0 pause"}
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == len(items)


def test_render_writes_the_png_and_the_trace(tmp_path) -> None:
    t = 5.0
    paths = _files(tmp_path, _record(0, t, [(t + .001, t + .002, t + .003, t + .004)]))
    timeline.render(paths, png=tmp_path / "t.png", trace=tmp_path / "t.json")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "t.json").read_text())["otherData"] == {"update": 3}


def test_records_without_bucket_times_or_the_version_are_refused(tmp_path) -> None:
    bare = _record(0, 1.0, [])
    with pytest.raises(ValueError, match=r"SyncConfig\(detail=True\)"):
        timeline.spans(timeline.load(_files(tmp_path, bare)))
    with pytest.raises(ValueError, match="no update 9 in every rank's records"):
        timeline.load(_files(tmp_path, bare), version=9)
