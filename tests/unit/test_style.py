"""House rules that can be checked on the source: small modules (a longer one says why at its
top), and a docstring on every public name of the package and on every declared interface."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import shardsync

ROOT = Path(shardsync.__file__).parent
MAX_LINES = 400


def test_no_module_over_400_lines_without_a_reason_at_its_top() -> None:
    long = []
    for p in sorted(ROOT.rglob("*.py")):
        lines = len(p.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(p.read_text())) or ""
        if lines > MAX_LINES and f"Over {MAX_LINES} lines" not in doc:
            long.append(f"{p.relative_to(ROOT)} ({lines} lines)")
    assert not long, f"split these, or say at their top why not ('Over {MAX_LINES} lines ...'): {long}"


def test_every_public_name_of_the_package_says_why() -> None:
    bare = [n for n in shardsync.__all__
            if (inspect.isclass(v := getattr(shardsync, n)) or inspect.isfunction(v)) and not inspect.getdoc(v)]
    assert not bare, f"public names without a docstring: {bare}"


def test_every_declared_interface_has_a_docstring() -> None:
    """Protocols and the bases whose hooks paths, destinations and channels override."""
    bare = []
    for p in sorted(ROOT.rglob("*.py")):
        tree = ast.parse(p.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
            if "Protocol" in bases and not ast.get_docstring(node):
                bare.append(f"{p.relative_to(ROOT)}:{node.name}")
    for module, name in (("shardsync.paths.base", "Program"), ("shardsync.receiver.destination", "Destination"),
                         ("shardsync.control.client", "UpdateChannel"), ("shardsync.control.client", "EngineClient"),
                         ("shardsync.runtime.executor", "Pooled"), ("shardsync.vocab", "Word"),
                         ("shardsync.views.base", "WeightView"), ("shardsync.views.base", "BoundView")):
        if not inspect.getdoc(getattr(importlib.import_module(module), name)):
            bare.append(f"{module}.{name}")
    assert not bare, f"interfaces without a docstring: {bare}"
