"""Which full-update path a connection uses: the fallback order, p2p's preconditions, and
the one log line a fallback produces."""

from __future__ import annotations

from shardsync.mode import Mode
from shardsync.plan.preconditions import check_p2p
from shardsync.topology import Topology

# Tried in order; a path is taken when its preconditions hold (broadcast has none).
FALLBACK_ORDER = (Mode.P2P, Mode.BROADCAST)
REQUESTS = ("auto", "p2p", "broadcast", "delta")


def choose_full(topo: Topology, requested: str) -> tuple[Mode, str | None]:
    """(the full-update path, why p2p was not taken).  ``requested`` is ``SyncConfig.mode``:
    auto and delta take p2p when it can run; p2p refuses (ValueError) when it cannot."""
    if requested not in REQUESTS:
        raise ValueError(f"mode must be one of {REQUESTS}, got {requested!r}")
    if requested == "broadcast":
        return Mode.BROADCAST, None
    failed = next((v for v in check_p2p(topo) if not v.ok), None)
    if failed is None:
        return Mode.P2P, None
    reason = f"p2p precondition {failed.name} failed: {failed.detail}"
    if requested == "p2p":
        raise ValueError(f"mode='p2p' requested but {reason}; use mode='auto' or 'broadcast'")
    return Mode.BROADCAST, reason
