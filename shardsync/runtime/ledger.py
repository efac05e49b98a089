"""One update's ledger: what a receive cost and moved, one engine rank's (``RankReport``) or
one engine's (``UpdateResult``), as one typed model that crosses processes as JSON.

Each field declares how an engine's ranks reduce it (``Reduce``), so an engine's result is
one generic reduce over the declared fields and a new field is one line here.  The serving
fields (``Served``) are the engine's, not a rank's: its scheduler measures them and hands
them to the reduce whole.  A rank's ledger is built from its executor's ``Stats`` once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

from shardsync.mode import Mode
from shardsync.runtime.stats import Stats
from shardsync.vocab import Staging


class Reduce(Enum):
    """How an engine's ranks reduce one ledger field into the engine's result."""

    MAX = "max"  # times and peaks: the slowest rank's, the largest buffer
    SUM = "sum"  # bytes and counts: the engine's total
    FIRST = "first"  # a fact every rank shares (where the bytes landed)
    OUTCOME = "outcome"  # ok and error: the first failed rank fails the engine (``UpdateResult.of``)


class Phase:
    """Marks a field as the seconds of one phase of an update: ``/metrics`` shows each."""


PHASE = Phase()


class _Account(BaseModel):
    # crosses processes (store values, HTTP answers, worker queues): nothing unknown, no inf/nan
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Cost(_Account):
    """What a receive cost and moved on one rank."""

    ok: Annotated[bool, Reduce.OUTCOME] = True
    error: Annotated[str | None, Reduce.OUTCOME] = None
    pack_s: Annotated[float, Reduce.MAX, PHASE] = 0.0
    transfer_s: Annotated[float, Reduce.MAX, PHASE] = 0.0
    unpack_s: Annotated[float, Reduce.MAX, PHASE] = 0.0
    derive_s: Annotated[float, Reduce.MAX, PHASE] = 0.0  # served state derived after the receive (FP8: quantize)
    total_s: Annotated[float, Reduce.MAX, PHASE] = 0.0
    bytes_received: Annotated[int, Reduce.SUM] = 0
    changed: Annotated[int, Reduce.SUM] = 0
    derived_changed: Annotated[int, Reduce.SUM] = 0  # FP8: e4m3 bytes and scales that changed
    buffer_bytes: Annotated[int, Reduce.MAX] = 0
    buckets: Annotated[int, Reduce.SUM] = 0
    destination: Annotated[str, Reduce.FIRST] = "params"


class Served(_Account):
    """Serving while syncing (``engine/dispatch.py``): where the engine stopped generating.
    The engine's own facts, never reduced over ranks."""

    staging: Staging = Staging.IN_PLACE
    staging_bytes: int = 0  # peak staging memory held for this update
    shard_bytes: int = 0  # the rank's whole shard: staging_bytes below it staged a window, the rest paused
    stage_s: Annotated[float, PHASE] = 0.0  # receive into staging while serving (0 in place)
    drain_s: Annotated[float, PHASE] = 0.0  # the commit waited this long for in-flight requests to finish on v
    commit_s: Annotated[float, PHASE] = 0.0  # make the received weights the served ones (swap or copy)
    pause_s: Annotated[float, PHASE] = 0.0  # engine not generating because of the update (in place: the receive)
    crossed: int = 0  # in-flight sequences the update crossed (re-prefilled under span, ended under abort)


class Ledger(Served, Cost):
    """A rank's costs, then the engine's serving facts: one flat JSON object on the wire
    (pydantic lays out the last base's fields first, so ``Cost``'s lead, as they always have)."""

    @classmethod
    def phases(cls) -> tuple[str, ...]:
        """The fields that are a phase's seconds, in field order."""
        return tuple(name for name, info in cls.model_fields.items() if PHASE in info.metadata)

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's seconds, by the phase's name (``pack`` for ``pack_s``)."""
        seconds = self.model_dump(include=set(self.phases()))
        return {name.removesuffix("_s"): seconds[name] for name in self.phases()}


class RankReport(Ledger):
    """One engine rank's ledger of one update (engines reduce them over their ranks)."""

    @classmethod
    def of(cls, stats: Stats, t0: float, destination: str) -> RankReport:
        """The one place a rank's ``Stats`` become its ledger; ``t0``: when the receive began
        (``time.perf_counter``)."""
        return cls(pack_s=stats.pack_s, transfer_s=stats.transfer_s, unpack_s=stats.unpack_s,
                   derive_s=stats.derive_s, derived_changed=stats.derived_changed,
                   total_s=time.perf_counter() - t0, bytes_received=stats.bytes_received, changed=stats.changed,
                   buffer_bytes=stats.peak_buffer_bytes, buckets=stats.buckets, destination=destination)


def _rule(info: FieldInfo) -> Reduce | None:
    return next((m for m in info.metadata if isinstance(m, Reduce)), None)


def _rules() -> dict[str, Reduce]:
    """Every ``Cost`` field's rule but the outcome's; a field that declares none is a bug, caught at import."""
    rules = {name: _rule(info) for name, info in Cost.model_fields.items()}
    missing = [name for name, rule in rules.items() if rule is None]
    if missing:
        raise TypeError(f"ledger fields {missing} declare no Reduce rule")
    return {name: rule for name, rule in rules.items() if rule is not None and rule is not Reduce.OUTCOME}


REDUCED = _rules()


def _fold(rule: Reduce, values: list[Any], default: Any) -> Any:
    if not values:
        return default
    if rule is Reduce.MAX:
        return max(values)
    if rule is Reduce.SUM:
        return sum(values)
    return values[0]


class UpdateResult(Ledger):
    """One engine's outcome of one update: its ranks' ledgers reduced, and its serving facts."""

    version: int
    mode: Mode
    ok: bool

    @classmethod
    def of(cls, version: int, mode: Mode, reports: Sequence[RankReport | dict[str, Any]], *,
           error: str | None = None, served: Served | None = None) -> UpdateResult:
        """Each field reduced over the ranks as it declares; the first failed rank (or ``error``)
        fails the engine as a whole, and then no rank's numbers count."""
        ranks = [r if isinstance(r, RankReport) else RankReport.model_validate(r) for r in reports]
        error = error or next((r.error or f"rank {i} failed" for i, r in enumerate(ranks) if not r.ok), None)
        rows = [r.model_dump(include=set(REDUCED)) for r in ranks] if error is None else []
        reduced = {name: _fold(rule, [row[name] for row in rows], Cost.model_fields[name].default)
                   for name, rule in REDUCED.items()}
        return cls(version=version, mode=mode, ok=error is None, error=error, **reduced, **dict(served or Served()))
