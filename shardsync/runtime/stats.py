"""``Stats``: what one sync rank did in one update, whatever the path.  Executor, paths,
receivers and records all speak it; the engine reduces its ranks' into one ``UpdateResult``."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class StepTiming:
    """One step's seconds, and (``detail``) when each part happened: wall-clock seconds of its
    start, its message posted (packed), landed (transfer done) and done (unpacked), so steps of
    several ranks on one machine line up on one timeline (``timeline.py``)."""

    label: str
    link: str
    bytes: int
    pack_s: float = 0.0
    transfer_s: float = 0.0
    unpack_s: float = 0.0
    start: float = 0.0
    posted: float = 0.0
    landed: float = 0.0
    done: float = 0.0


@dataclass
class Stats:
    """Seconds and bytes of one rank's update.  ``pack`` is packing or delta encoding,
    ``unpack`` unpacking or delta apply; ``derive`` what a receiver derives from the received
    weights before they are served (an FP8 engine quantizes; on a trainer rank: what it quantizes
    before the send); ``changed`` and ``elements`` count delta elements."""

    pack_s: float = 0.0
    transfer_s: float = 0.0
    unpack_s: float = 0.0
    derive_s: float = 0.0
    derived_changed: int = 0  # derived elements that differ from the served ones (FP8: e4m3 bytes and scales)
    bytes_sent: int = 0
    bytes_received: int = 0
    changed: int = 0
    elements: int = 0
    peak_buffer_bytes: int = 0
    buckets: int = 0
    encodings: Counter = field(default_factory=Counter)
    steps: list[StepTiming] = field(default_factory=list)

    _SUMMED = ("pack_s", "transfer_s", "unpack_s", "derive_s", "derived_changed", "bytes_sent", "bytes_received",
               "changed", "elements", "buckets")

    def merge(self, other: Stats) -> Stats:
        """Add ``other`` (another stage or part of the same update) into this one."""
        for k in self._SUMMED:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, other.peak_buffer_bytes)
        self.encodings.update(other.encodings)
        self.steps.extend(other.steps)
        return self

    def steps_json(self) -> list[dict]:
        return [asdict(s) for s in self.steps]
