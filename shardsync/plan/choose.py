"""Which full-update path a connection takes: the fallback order, each path's preconditions,
and the one reason a fallback logs.  ``WeightSync.connect`` and the fallback matrix
(``plan.matrix``) both decide here, from the same verdicts."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from shardsync.mode import Mode
from shardsync.plan.preconditions import Verdict, check_p2p
from shardsync.topology import Topology
from shardsync.vocab import Request

# Tried in this order; a path is taken when its preconditions hold (broadcast has none).
FALLBACK_ORDER: tuple[Mode, ...] = (Mode.P2P, Mode.BROADCAST)
PRECONDITIONS: dict[Mode, Callable[[Topology], Sequence[Verdict]]] = {
    Mode.P2P: check_p2p,
    Mode.BROADCAST: lambda topo: (),
}


def choose(verdicts: Mapping[Mode, Sequence[Verdict]], requested: Request | str) -> tuple[Mode, str | None]:
    """(the full-update path, why an earlier one in ``FALLBACK_ORDER`` was not taken).
    ``requested`` is ``SyncConfig.mode``: auto walks the order, p2p refuses (ValueError) when
    p2p cannot run, broadcast takes broadcast."""
    request = Request.parse(requested, "mode")
    order = {Request.AUTO: FALLBACK_ORDER, Request.P2P: (Mode.P2P,), Request.BROADCAST: (Mode.BROADCAST,)}[request]
    skipped: str | None = None
    for mode in order:
        failed = next((v for v in verdicts.get(mode, ()) if not v.ok), None)
        if failed is None:
            return mode, skipped
        reason = f"{mode} precondition {failed.name} failed: {failed.detail}"
        if request is not Request.AUTO:
            raise ValueError(f"mode={request.value!r} requested but {reason}; use mode='auto' or 'broadcast'")
        skipped = skipped or reason
    raise ValueError(f"no path's preconditions hold ({skipped})")  # broadcast has none: not reached


def choose_full(topo: Topology, requested: Request | str) -> tuple[Mode, str | None]:
    """``choose`` over ``topo``'s verdicts for every path of the order."""
    return choose({mode: PRECONDITIONS[mode](topo) for mode in FALLBACK_ORDER}, requested)
