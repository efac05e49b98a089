"""Timing provenance, fail-closed: a result says how it was timed or it is not reported."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from shardsync.bench.transport import CLOCK


class ProvenanceError(ValueError):
    """Timings that must not be reported (unsynchronized on a device, or too few iterations)."""


@dataclass(frozen=True, kw_only=True)
class Provenance:
    backend: str
    device: str
    clock: str = CLOCK
    clock_domain: str = "host"  # "host": one monotonic clock for all ranks; "rank": t0-aligned
    hosts: int = 1
    sync_points: tuple[str, ...] = field(default=())
    device_syncs: int = 0
    timed_transfers: int = 0
    unsynced_transfers: int = 0
    incomplete_transfers: int = 0
    warmup_asked: int = 0
    warmup_done: int = 0
    iters_asked: int = 0
    iters_measured: int = 0
    torch: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def check(p: Provenance, what: str = "result") -> None:
    """Raise ``ProvenanceError`` naming every reason ``p``'s timings cannot be reported."""
    problems = []
    if p.clock != CLOCK:
        problems.append(f"clock {p.clock!r} is not the monotonic {CLOCK}")
    if p.device.startswith("cuda") and (p.unsynced_transfers or p.device_syncs < p.timed_transfers):
        problems.append(f"{p.unsynced_transfers} of {p.timed_transfers} transfer completions on "
                        f"{p.device} were timed without a device synchronization")
    if p.incomplete_transfers:
        problems.append(f"{p.incomplete_transfers} transfer(s) have no completion time")
    if p.iters_measured < p.iters_asked:
        problems.append(f"{p.iters_measured} measured iteration(s), {p.iters_asked} asked")
    if p.warmup_done < p.warmup_asked:
        problems.append(f"{p.warmup_done} warm-up iteration(s), {p.warmup_asked} asked")
    if p.timed_transfers == 0:
        problems.append("no transfer was timed")
    if problems:
        raise ProvenanceError(f"refusing to report {what}: " + "; ".join(problems))
