"""Before any weight byte moves, every member of a process group proves to every other one
that it holds the sync's secret, over the group's own connections.

Signed rendezvous values (``store/signed.py``) keep a rogue address out of the store; this
proof catches whoever got into a connection anyway (say, by racing a peer to a listening
socket).  Each member sends each peer an HMAC bound to the connection's name (fresh per
connect), the group and both ranks, and checks the one it receives: a tag seen on another
connection or another pair is worth nothing.  Pairs meet in round-robin rounds (every
member at most one peer per round), so blocking point-to-point backends (NCCL) cannot
deadlock and the proof costs n - 1 small round trips per member, once per connect.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from collections.abc import Callable
from typing import Any

import torch

_TAG = b"shardsync-group-proof\0"


class ProofError(RuntimeError):
    """A peer that did not prove it holds the sync's secret: the group is not used."""


def tag(secret: str, context: str, sender: int, receiver: int) -> bytes:
    return hmac.new(secret.encode(), _TAG + f"{context}\0{sender}\0{receiver}".encode(), hashlib.sha256).digest()


def rounds(size: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``size`` members once, in rounds that are matchings (the circle method:
    ``size - 1`` rounds, ``size`` when odd, where one member per round sits out)."""
    n = size + size % 2  # an odd group gets a missing member, ``size``
    out = []
    for r in range(n - 1):
        pairs = [(r, n - 1)] + [(i, (2 * r - i) % (n - 1)) for i in range(n - 1) if i != r]
        out.append(sorted({(min(a, b), max(a, b)) for a, b in pairs if a < size and b < size}))
    return out


def partners(size: int, me: int) -> list[int]:
    """``me``'s peers in round order."""
    return [b if a == me else a for pairs in rounds(size) for a, b in pairs if me in (a, b)]


def prove(pg: Any, size: int, me: int, *, context: str, secret: str, timeout: datetime.timedelta,
          device: torch.device | None, who: Callable[[int], str]) -> None:
    """Exchange proofs with every peer of ``pg`` (rank ``me`` of ``size``; ``who`` names a
    peer's group rank for the error).  Collective over the group; raises ``ProofError``."""
    for peer in partners(size, me):
        mine = torch.frombuffer(bytearray(tag(secret, context, me, peer)), dtype=torch.uint8)
        theirs = torch.zeros_like(mine)
        if device is not None:
            mine, theirs = mine.to(device), theirs.to(device)
        if me < peer:  # the lower rank speaks first: a blocking backend matches every call
            pg.send([mine], peer, 0).wait(timeout)
            pg.recv([theirs], peer, 0).wait(timeout)
        else:
            pg.recv([theirs], peer, 0).wait(timeout)
            pg.send([mine], peer, 0).wait(timeout)
        got = theirs.cpu().numpy().tobytes()
        if not hmac.compare_digest(got, tag(secret, context, peer, me)):
            raise ProofError(f"{who(peer)} did not prove it holds the sync's secret (connection {context}): "
                             "whoever answered there is not a member; the connect is refused and no weight "
                             "byte was exchanged with it")
