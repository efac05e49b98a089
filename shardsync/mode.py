"""The update path as one typed value: what trainer, receiver, wire and records all name."""

from __future__ import annotations

from enum import Enum


class Mode(str, Enum):
    """A path of one update.  The value is the wire and record spelling."""

    P2P = "p2p"
    BROADCAST = "broadcast"
    DELTA_P2P = "delta-p2p"
    DELTA_BROADCAST = "delta-broadcast"
    DELTA_DISK = "delta-disk"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @property
    def is_delta(self) -> bool:
        return self in (Mode.DELTA_P2P, Mode.DELTA_BROADCAST, Mode.DELTA_DISK)

    @property
    def plan(self) -> Mode:
        """The full-update plan whose fingerprint guards this path (and whose parts a delta diffs)."""
        return Mode.P2P if self in (Mode.P2P, Mode.DELTA_P2P) else Mode.BROADCAST

    @property
    def over_group(self) -> bool:
        """Whether the bytes move through the sync group (disk deltas go through files)."""
        return self is not Mode.DELTA_DISK

    @staticmethod
    def delta(transport: str) -> Mode:
        """The delta path over ``transport`` (p2p, broadcast or disk)."""
        return Mode(f"delta-{transport}")


FULL = (Mode.P2P, Mode.BROADCAST)
