"""Progress lines (``progress.py``): quiet while work is short, a line per stage after."""

from __future__ import annotations

import io

from shardsync.progress import Progress


def test_quiet_before_the_threshold_then_a_line_per_stage() -> None:
    out = io.StringIO()
    quiet = Progress("planning X", after_s=60.0, stream=out)
    quiet("layouts")
    assert out.getvalue() == "" and quiet.lines == 0
    loud = Progress("planning X", after_s=0.0, stream=out)
    loud("layouts")
    loud("p2p plan")
    lines = out.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["planning X: layouts", "planning X: p2p plan"]
    assert all(line.endswith(" s)") for line in lines)
