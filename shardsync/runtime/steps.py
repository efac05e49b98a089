"""Steps: what one rank does with one message buffer, compiled once from plan buckets.

A step's buffer is filled (pack local tensors, or receive sub-messages into it),
moved (send / recv / broadcast), then drained (unpack into local tensors).  Every path
(p2p, broadcast with its gather, a rank-local copy) is a list of steps; one executor
runs them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Region = tuple[slice, ...]


def full_region(shape: tuple[int, ...]) -> Region:
    return tuple(slice(0, s) for s in shape)


@dataclass(frozen=True, slots=True)
class Binding:
    """``tensors[key][region]`` <-> ``buffer[offset : offset+prod(box)].view(box)[sub]``.

    ``space`` says where ``key`` lives: ``"local"`` (the rank's parameters) or ``"main"``
    (views into the buffer of the step being filled, for gathers).  ``raw``: the dtype whose
    bits the buffer carries for this binding (a tensor both ends hold wider than the wire,
    moved without rounding: the buffer span is its bytes); None: cast to the wire dtype.
    """

    key: str
    region: Region
    offset: int
    box: tuple[int, ...]
    sub: Region
    space: str = "local"
    raw: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.box:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class SubRecv:
    """A message received before the step's own transfer, unpacked into the step's buffer."""

    peer: int
    numel: int
    bindings: tuple[Binding, ...]


@dataclass(frozen=True)
class Step:
    """One buffer lifetime.

    ``comm``: ("send", peer), ("recv", peer), ("bcast", group, root, i_am_root) or () for a
    rank-local copy.  ``main_views`` name (key, offset, shape, raw dtype) views of the step's
    own buffer that ``fill`` sub-messages unpack into.
    """

    label: str
    numel: int
    comm: tuple
    pack: tuple[Binding, ...] = ()
    fill: tuple[SubRecv, ...] = ()
    drain: tuple[Binding, ...] = ()
    main_views: tuple[tuple[str, int, tuple[int, ...], str | None], ...] = field(default=())  # + raw dtype
    link: str = ""
    fence: bool = False  # complete every earlier step first (a relay reads what was received)
