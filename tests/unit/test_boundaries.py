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
    """The room of a ``shardsync`` module, as the architecture's table names it (a module of a
    package whose modules sit in different rooms is named itself: ``plan.choose``)."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else ""
    sub = ".".join(parts[1:3])
    return ROOMS.get(sub, ROOMS.get(top, top))


# the plan algebra's modules; the rest of ``plan/`` reads topologies (``planning``)
PLANNING = ("choose", "preconditions", "summary", "matrix", "fabric", "tuning")
ROOMS = {"vocab": "mode", "store": "store",
         "dtypes": "basics", "gcpause": "basics", "units": "basics", "piece": "pieces",
         "spec": "model", "presets": "model", "family": "model",
         "layout": "layout", "plan": "plan", **{f"plan.{m}": "planning" for m in PLANNING},
         "quant": "formats", "lora": "formats", "views": "views", "topology": "topology",
         "sync": "trainer", "config": "trainer", "connection": "trainer", "fsdp2": "trainer", "viewed": "trainer",
         "launch": "programs", "demo": "programs", "bench": "programs",
         "cli": "programs", "__main__": "programs", "timeline": "programs", "progress": "programs",
         "": "package", "placement": "placement"}
# the metadata band, bottom up: each room may import the ones before it
BAND = ("basics", "pieces", "model", "layout", "plan", "formats", "views", "topology", "planning")
METADATA = set(BAND)
BELOW_PATHS = {"mode", "store", "runtime", "transport", "delta"} | METADATA
# room -> the rooms it may import (besides itself)
MAY_IMPORT: dict[str, set[str]] = {
    "mode": set(),
    "store": set(),
    **{room: {"mode", *BAND[:i]} for i, room in enumerate(BAND)},
    "runtime": {"mode"} | METADATA,
    "transport": {"mode", "runtime", "store"} | METADATA,
    "delta": {"mode", "runtime", "transport", "store"} | METADATA,
    "paths": BELOW_PATHS,
    "control": {"mode", "store", "runtime", "transport"} | METADATA,
    "receiver": BELOW_PATHS | {"paths", "control"},
    "trainer": BELOW_PATHS | {"paths", "control", "receiver"},
    "placement": set(),
    # trainer: the FSDP2 trainer reads fsdp2.py; runtime: the FP8 GEMM's activations cast by its kernel
    "models": {"mode", "store", "runtime", "trainer"} | METADATA,
    "engines": BELOW_PATHS | {"paths", "control", "receiver"},
    "engine": BELOW_PATHS | {"paths", "control", "receiver", "models", "placement"},
    "programs": BELOW_PATHS | {"paths", "control", "receiver", "trainer", "models", "engine", "engines",
                               "placement"},
    "package": {"mode", "store", "trainer", "receiver", "control"} | METADATA,  # lazy public names
}
# imports that run against the table, each named (docs/architecture.md lists them); shrink this
UPWARD: set[str] = {
    # a spec counts its parameters from its logical tensors, which the layout room reads off the tables
    "shardsync.spec -> shardsync.layout.logical",
}


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


def test_every_module_imports_first_in_a_fresh_process() -> None:
    """An import cycle shows only when the cycle's other end is imported first (``python -m
    shardsync.cli demo`` once found ``launch -> demo -> launch``): each package, whose
    ``__init__`` imports its room, is imported with every shardsync module dropped before it
    (the engines' integrations need their engines)."""
    modules = sorted(".".join(p.parent.relative_to(ROOT.parent).parts) for p in ROOT.rglob("__init__.py")
                     if "engines" not in p.parts) + ["shardsync.cli"]
    code = ("import importlib, sys, torch\n"
            "bad = []\n"
            f"for m in {modules!r}:\n"
            "    for k in [k for k in sys.modules if k.split('.')[0] == 'shardsync']:\n"
            "        del sys.modules[k]\n"
            "    try:\n"
            "        importlib.import_module(m)\n"
            "    except ImportError as e:\n"
            "        bad.append(f'{m}: {e}')\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout
