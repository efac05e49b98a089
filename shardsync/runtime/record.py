"""Update records: what one update moved and where its time went."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from shardsync.runtime.ledger import UpdateResult
from shardsync.runtime.stats import Stats
from shardsync.vocab import Staging

if TYPE_CHECKING:
    from shardsync.mode import Mode
    from shardsync.topology import Topology

log = logging.getLogger("shardsync")


@dataclass(frozen=True)
class UpdateRecord:
    """What one update did, on one trainer rank: its path (and why not p2p), bytes per link,
    buckets, the seconds of each phase, each engine's result; one JSON line per update."""

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
    engines: list[UpdateResult] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    delta: dict[str, Any] | None = None
    source: str = "device"  # where the trainer's weights were read from: device | host | host-pinned
    unsent_bytes: int = 0  # the trainer's tensors no engine holds (MTP layers), at the wire dtype: not moved
    started_at: float = 0.0  # wall-clock seconds when the update began (steps' times are wall-clock too)
    # FP8 engines, with ``detail``: this rank's e4m3 bytes and scales that changed since its last send
    quantized_changed: int = 0
    adapter: dict[str, int] | None = None  # an adapter sync: its rank, adapter_bytes and base_bytes (not moved)

    @property
    def total_s(self) -> float:
        return self.phases.get("total", 0.0)

    @property
    def pause_s(self) -> float:
        """The longest any engine stopped generating for this update (``engine/dispatch.py``)."""
        return max((e.pause_s for e in self.engines), default=0.0)

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
                f"buckets={self.buckets} total={self.total_s * 1e3:.1f}ms ({phases}) {gbps:.3f}GB/s"
                f"{self._serving()}{self._unsent()}{self._adapter()}")

    def _adapter(self) -> str:
        a = self.adapter
        return (f" adapter=r{a['rank']} {a['adapter_bytes'] / 2**20:.2f}MiB (base {a['base_bytes'] / 2**20:.1f}MiB "
                "not moved)" if a else "")

    def _unsent(self) -> str:
        return f" unsent={self.unsent_bytes / 2**20:.2f}MiB (no engine holds them)" if self.unsent_bytes else ""

    def _serving(self) -> str:
        """Where the engines stopped generating: `` engine_pause=..ms (staged ..)``."""
        if not self.engines:
            return ""
        staged = [e for e in self.engines if e.staging is not Staging.IN_PLACE]
        window = [e for e in staged if e.staging_bytes < e.shard_bytes]
        share = (f", window {min(e.staging_bytes / e.shard_bytes for e in window):.0%} of the shard"
                 if window else "")
        how = (f"staged {max(e.stage_s for e in staged) * 1e3:.1f}ms, "
               f"commit {max(e.commit_s for e in staged) * 1e3:.2f}ms{share}" if staged else "in place")
        return f" engine_pause={self.pause_s * 1e3:.2f}ms ({how})"

    def metrics(self, prefix: str = "perf/", *, text: bool = True) -> dict[str, float | str]:
        """This update as one flat dict in the names RL trainers log (slime's
        ``perf/update_weights_time``; ``prefix="timing_s/"`` for verl's), ready for
        ``wandb.log``; ``text=False`` keeps numbers only (tensorboard's ``add_scalars``)."""
        name = f"{prefix}update_weights"
        moved = sum(self.link_bytes.values()) or self.bytes_sent  # rank 0 knows every link; others their own
        out: dict[str, float | str] = {f"{name}_time": self.total_s}
        out.update({f"{name}_{phase}_time": s for phase, s in self.phases.items() if phase != "total"})
        out.update({f"{name}_engine_pause_time": self.pause_s, f"{name}_bytes": moved,
                    f"{name}_busiest_link_bytes": self.busiest_link_bytes,
                    f"{name}_gbps": moved / self.total_s / 1e9 if self.total_s > 0 else 0.0,
                    f"{name}_buckets": self.buckets, f"{name}_ok": float(self.ok), f"{name}_version": self.version})
        if text:
            out[f"{name}_path"] = self.mode
            if self.fallback_reason:
                out[f"{name}_fallback_reason"] = self.fallback_reason
        return out

    def engines_json(self) -> list[dict[str, Any]]:
        """The engines' results as plain JSON objects (records.jsonl's ``engines``, the wire's shape)."""
        return [e.model_dump(mode="json") for e in self.engines]

    def to_json(self) -> str:
        out = asdict(replace(self, engines=[]))  # the ledgers are pydantic models, not dataclasses
        out["engines"] = self.engines_json()
        return json.dumps(out)


def append_jsonl(path: str | Path, record: UpdateRecord) -> None:
    with open(path, "a") as f:
        f.write(record.to_json() + "\n")


class _Common(TypedDict):
    """The ``UpdateRecord`` fields every mode's record sets alike (``make_record``)."""

    version: int
    mode: str
    ok: bool
    rank: int
    error: str | None
    source: str
    bytes_sent: int
    engines: list[UpdateResult]
    phases: dict[str, float]
    unsent_bytes: int
    started_at: float
    quantized_changed: int
    adapter: dict[str, int] | None


def make_record(version: int, mode: Mode, error: str | None, stats: Stats | None,
                engines: list[UpdateResult], times: dict[str, float], *, rank: int, topo: Topology,
                detail: bool, fallback_reason: str | None, buckets: int, source: str = "device",
                started_at: float = 0.0) -> UpdateRecord:
    """A trainer rank's record of one update: its own ``Stats``, the engines' results, and the
    control times around them.  ``unpack`` and ``derive`` are the slowest engine's; ``quantize``
    this rank's (an FP8 engine's weights quantized before the send: ``runtime.quantizer``)."""
    stats = stats or Stats()
    unpack = max((e.unpack_s for e in engines), default=0.0)
    derive = max((e.derive_s for e in engines), default=0.0)
    phases = {"plan": times["plan"], "pack": stats.pack_s, "transfer": stats.transfer_s, "unpack": unpack,
              "derive": derive, "quantize": stats.derive_s,
              **{k: v for k, v in times.items() if k != "plan"}}
    common = _Common(version=version, mode=mode.value, ok=error is None, rank=rank, error=error, source=source,
                     bytes_sent=stats.bytes_sent, engines=list(engines), phases=phases,
                     unsent_bytes=topo.unsent_bytes, started_at=started_at,
                     quantized_changed=stats.derived_changed, adapter=topo.adapter)
    if mode.is_delta:
        delta = {"elements": stats.elements, "bytes_sent": stats.bytes_sent, "encodings": dict(stats.encodings),
                 "engine_changed": sum(e.changed for e in engines),
                 "engine_bytes_received": sum(e.bytes_received for e in engines)}
        return UpdateRecord(fallback_reason=None, buckets=0, delta=delta,
                            link_bytes={f"rank{rank}->engines": stats.bytes_sent}, **common)
    plan = topo.p2p_plan if mode.value == "p2p" else topo.broadcast_plan
    links = ({f"{plan.src.ranks[s].label}->{plan.dst.ranks[d].label}": b for (s, d), b in plan.link_bytes.items()}
             if rank == 0 else {})
    return UpdateRecord(fallback_reason=fallback_reason, buckets=buckets, buffer_bytes=stats.peak_buffer_bytes,
                        link_bytes=links, steps=stats.steps_json() if detail else [], **common)
