"""The quick soak (``benchmarks/soak.py --quick``) as a regression test: every injected fault
is detected and recovered from, and all four totals are zero.  Its own CI step
(``pytest -q -m soak``): it takes about three minutes of the main suite's ten."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.soak
def test_quick_soak_detects_and_recovers_from_every_fault(tmp_path) -> None:
    out = tmp_path / "soak.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--quick", "--ipc-updates", "2",
                        "--workdir", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["faults"]) == 9
    for f in res["faults"]:
        assert f["detected"] and f["recovered"], f
    assert res["totals"] == {"hangs beyond timeout": 0, "responses served from mixed weights": 0,
                             "silent corruptions": 0, "leaked processes/shm": 0}, res["totals"]
    assert res["client_answers"] > 0 and {"p2p", "broadcast", "delta-p2p", "p2p (ipc map)"} <= set(res["updates"])
