"""Room boundaries the architecture promises (docs/architecture.md), checked on the source."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "shardsync"


def test_receiver_imports_no_web_framework_and_no_reference_engine() -> None:
    code = ("import sys, shardsync.receiver; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', "
            "'httpx') or m.startswith('shardsync.engine') or m.startswith('shardsync.models')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_nothing_in_the_package_unpickles_or_torch_loads() -> None:
    pattern = re.compile(r"pickle\.loads?\(|torch\.load\(|ForkingPickler|broadcast_object_list|"
                         r"all_gather_object|reduce_tensor")
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in ROOT.rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_control_room_imports_no_engine_and_no_web_framework() -> None:
    bad = []
    for p in (ROOT / "control").rglob("*.py"):
        for line in p.read_text().splitlines():
            if re.match(r"\s*(from|import) (shardsync\.(engine|models|sync|receiver)|fastapi|uvicorn)", line):
                bad.append(f"{p.name}: {line.strip()}")
    assert bad == []
