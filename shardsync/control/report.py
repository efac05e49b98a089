"""What an engine tells the trainer after an update: each rank's ``RankReport`` from its
``Stats``, reduced into the engine's ``UpdateResult`` (times: the slowest rank)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from shardsync.control.wire import RankReport, UpdateResult
from shardsync.mode import Mode
from shardsync.runtime.stats import Stats


def rank_report(stats: Stats, t0: float, destination: str) -> RankReport:
    return RankReport(pack_s=stats.pack_s, transfer_s=stats.transfer_s, unpack_s=stats.unpack_s,
                      total_s=time.perf_counter() - t0, bytes_received=stats.bytes_received,
                      changed=stats.changed, buffer_bytes=stats.peak_buffer_bytes, buckets=stats.buckets,
                      destination=destination)


def reduce_reports(version: int, mode: Mode, reports: Sequence[RankReport | dict],
                   error: str | None = None) -> UpdateResult:
    """One engine's result; the first rank error (or ``error``) fails it as a whole."""
    rs = [r if isinstance(r, RankReport) else RankReport.model_validate(r) for r in reports]
    error = error or next((r.error or f"rank {i} failed" for i, r in enumerate(rs) if not r.ok), None)
    ok = rs if error is None else []

    def top(k: str) -> float:
        return max((getattr(r, k) for r in ok), default=0.0)

    return UpdateResult(version=version, mode=mode, ok=error is None, error=error,
                        pack_s=top("pack_s"), transfer_s=top("transfer_s"), unpack_s=top("unpack_s"),
                        total_s=top("total_s"), bytes_received=sum(r.bytes_received for r in ok),
                        changed=sum(r.changed for r in ok), buffer_bytes=int(top("buffer_bytes")),
                        buckets=sum(r.buckets for r in ok), destination=ok[0].destination if ok else "params")
