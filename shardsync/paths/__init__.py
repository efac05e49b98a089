"""Paths as first-class objects: one registry from ``Mode`` to the compiler of its program.

Trainer ranks and receivers both call ``compile_path`` with their ``Endpoint``; the same
code derives the same steps on both ends.  Adding a path = a module here + a registry row.
"""

from __future__ import annotations

from collections.abc import Callable

from shardsync.mode import FULL, Mode
from shardsync.paths.base import Colocated, DeltaSide, Endpoint, Program, UpdateArgs
from shardsync.paths.broadcast import BroadcastProgram
from shardsync.paths.delta import DeltaProgram
from shardsync.paths.disk import DiskWrite
from shardsync.paths.p2p import compile_p2p
from shardsync.plan.choose import FALLBACK_ORDER, choose_full

PATHS: dict[Mode, Callable[[Endpoint], Program]] = {
    Mode.P2P: compile_p2p,
    Mode.BROADCAST: BroadcastProgram,
    Mode.DELTA_P2P: lambda ep: DeltaProgram(ep, Mode.DELTA_P2P),
    Mode.DELTA_BROADCAST: lambda ep: DeltaProgram(ep, Mode.DELTA_BROADCAST),
    Mode.DELTA_DISK: DiskWrite,  # trainer side; engines apply with ``paths.disk.DiskApply``
}


def compile_path(mode: Mode, ep: Endpoint) -> Program:
    return PATHS[mode](ep)


def release(programs: dict[Mode, Program], group) -> None:
    """End a connection on this rank: every program first (colocated transports unmap), then
    the sync group.  Both ends call it when they leave, or after a failed collective."""
    for p in programs.values():
        p.close()
    programs.clear()
    if group is not None:
        group.close()


def connection_modes(full: Mode, delta: str | None) -> tuple[Mode, ...]:
    """The paths one connection compiles: both full paths when p2p can run (an update may
    pick either), else broadcast; plus the delta path over ``delta`` when delta is on.  A
    delta over p2p without the p2p plan goes over broadcast."""
    modes: tuple[Mode, ...] = FULL if full is Mode.P2P else (Mode.BROADCAST,)
    if delta is not None:
        modes += (Mode.delta("broadcast" if delta == "p2p" and full is not Mode.P2P else delta),)
    return modes


__all__ = ["FALLBACK_ORDER", "PATHS", "Colocated", "DeltaSide", "Endpoint", "Mode", "Program", "UpdateArgs",
           "choose_full", "compile_path", "connection_modes", "release"]
