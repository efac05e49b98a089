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


# -- the whole room table (docs/architecture.md, "Rooms"), cell by cell --

def room_of(module: str) -> str:
    """The room of a ``shardsync`` module, as the architecture's table names it."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    return ROOMS.get(top, top)


ROOMS = {"vocab": "mode", "store": "store",
         "spec": "metadata", "presets": "metadata", "family": "metadata", "topology": "metadata",
         "layout": "metadata", "plan": "metadata", "quant": "metadata", "lora": "metadata",
         "dtypes": "metadata", "gcpause": "metadata", "views": "metadata", "units": "metadata",
         "sync": "trainer", "config": "trainer", "connection": "trainer",
         "fsdp2": "trainer", "launch": "programs", "demo": "programs", "bench": "programs",
         "cli": "programs", "__main__": "programs", "timeline": "programs", "progress": "programs",
         "": "package", "placement": "placement"}
BELOW_PATHS = {"mode", "store", "metadata", "runtime", "transport", "delta"}
# room -> the rooms it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "mode": set(),
    "store": set(),
    "metadata": {"mode"},
    "runtime": {"mode", "metadata"},
    "transport": {"mode", "metadata", "runtime", "store"},
    "delta": {"mode", "metadata", "runtime", "transport", "store"},
    "paths": BELOW_PATHS,
    "control": {"mode", "store", "metadata", "runtime", "transport"},
    "receiver": BELOW_PATHS | {"paths", "control"},
    "trainer": BELOW_PATHS | {"paths", "control", "receiver"},
    "placement": set(),
    "models": {"mode", "store", "metadata", "trainer"},  # trainer: the FSDP2 trainer reads fsdp2.py
    "engines": BELOW_PATHS | {"paths", "control", "receiver"},
    "engine": BELOW_PATHS | {"paths", "control", "receiver", "models", "placement"},
    "programs": BELOW_PATHS | {"paths", "control", "receiver", "trainer", "models", "engine", "engines",
                               "placement"},
    "package": {"mode", "store", "metadata", "trainer", "receiver", "control"},  # lazy public names
}
# imports that run against the table, each named (docs/architecture.md lists them); shrink this
UPWARD: set[str] = set()


def _imports() -> list[tuple[str, str]]:
    import ast

    out = []
    for p in ROOT.rglob("*.py"):
        module = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            out += [(module, n) for n in names if n.startswith("shardsync")]
    return out


def test_every_import_follows_the_room_table() -> None:
    against = set()
    for module, target in _imports():
        src, dst = room_of(module), room_of(target)
        assert src in MAY_IMPORT, f"{module}: room {src!r} is not in the table; add it to docs/architecture.md"
        assert dst in MAY_IMPORT, f"{target}: room {dst!r} is not in the table; add it to docs/architecture.md"
        if src != dst and dst not in MAY_IMPORT[src]:
            against.add(f"{module} -> {target}")
    assert against - UPWARD == set(), "imports against docs/architecture.md's room table"
    assert UPWARD - against == set(), "named upward imports that are gone: drop them from UPWARD and the doc"
