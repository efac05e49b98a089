"""Update records: what one update moved and where its time went."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("shardsync")


@dataclass(frozen=True)
class UpdateRecord:
    version: int
    mode: str
    fallback_reason: str | None
    ok: bool
    rank: int
    bytes_sent: int
    buckets: int
    phases: dict[str, float]
    buffer_bytes: int = 0
    link_bytes: dict[str, int] = field(default_factory=dict)
    engines: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    delta: dict[str, Any] | None = None

    @property
    def total_s(self) -> float:
        return self.phases.get("total", 0.0)

    @property
    def busiest_link_bytes(self) -> int:
        return max(self.link_bytes.values(), default=0)

    def summary(self) -> str:
        total = sum(self.link_bytes.values())
        gbps = total / self.total_s / 1e9 if self.total_s > 0 else 0.0
        phases = " ".join(f"{k}={v * 1e3:.1f}ms" for k, v in self.phases.items() if k != "total")
        why = f" (fallback: {self.fallback_reason})" if self.fallback_reason else ""
        return (f"weight update v{self.version} mode={self.mode}{why} ok={self.ok} "
                f"bytes={total / 2**20:.2f}MiB busiest_link={self.busiest_link_bytes / 2**20:.2f}MiB "
                f"buckets={self.buckets} total={self.total_s * 1e3:.1f}ms ({phases}) {gbps:.3f}GB/s")

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def append_jsonl(path: str | Path, record: UpdateRecord) -> None:
    with open(path, "a") as f:
        f.write(record.to_json() + "\n")
