"""Rows of a family's tables read as local tensors: every row that exists for a spec and a
layout's variants, cut by its kind's own rule (``family.cut.Kind``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from shardsync.family.cut import Cut, Local
from shardsync.family.table import Row


def cut_rows(rows: Iterable[Row], c: Cut) -> list[tuple[Local, str | None]]:
    """Every row that exists for the spec as (local tensor, its dtype when not the model's)."""
    out: list[tuple[Local, str | None]] = []
    for row in rows:
        if not row.exists(c.spec, c.variants):
            continue
        made = row.kind.cut(row.name, c.local + row.name.format(**c.names), c)
        out += [(replace(m, fp8=row.fp8), row.dtype) for m in made]
    return out
