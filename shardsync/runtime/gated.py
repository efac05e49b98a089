"""``Gated``: a receive's tensors when only a window of them is staged.

Window tensors are staging copies, written while the engine serves; every other tensor is
the live parameter itself, so the first access to one of those (a receive posted into it, a
drain, a delta scatter) first calls ``open`` - the engine pauses there - and the rest of the
update lands in place.  Paths need not know: they index the mapping at write time.  A path
that compiles views ahead (the mapped transport) reads them through ``ungated`` and calls
``open`` itself before its first live copy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch


class Gated(Mapping[str, torch.Tensor]):
    def __init__(self, staging: Mapping[str, torch.Tensor], live: Mapping[str, torch.Tensor],
                 open: Callable[[], None]) -> None:
        self._staging, self._live, self._open = dict(staging), dict(live), open
        self.window = frozenset(self._staging)

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._staging.get(name)
        if t is not None:
            return t
        t = self._live[name]
        self._open()
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self._live)

    def __len__(self) -> int:
        return len(self._live)

    def open(self) -> None:
        """Pause the engine (once per receive): what follows writes served weights."""
        self._open()

    @property
    def ungated(self) -> dict[str, torch.Tensor]:
        """Every tensor, without opening: for compiling views, never for writing."""
        return {n: self._staging.get(n, t) for n, t in self._live.items()}

    def mapped(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> Gated:
        """The same gate over ``fn(name, tensor)`` of every tensor (views of them)."""
        return Gated({n: fn(n, t) for n, t in self._staging.items()},
                     {n: fn(n, t) for n, t in self._live.items()}, self._open)


def ungated(tensors: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Every tensor of a receive's mapping, without opening a gate (for compiling views)."""
    return tensors.ungated if isinstance(tensors, Gated) else tensors


def window_of(tensors: Mapping[str, torch.Tensor]) -> frozenset[str] | None:
    """The staged names of a receive's mapping, or None when every tensor is written as is."""
    return tensors.window if isinstance(tensors, Gated) else None
