"""Split a launched world into trainer ranks and engine groups (pure).

Ranks ``0..T-1`` are trainer ranks; the remaining ranks form engine groups in rank
order.  Engine group ``g`` is fed by trainer rank ``g % T`` (its sender) and owns two
subgroups: ``data{g}`` (sender first, then the group's ranks; broadcasts run there) and
``ctrl{g}`` (every trainer rank, then the group's ranks; its go/done barriers).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class BenchLayout:
    world_size: int
    trainers: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]

    @cached_property
    def _group_of(self) -> dict[int, int]:
        return {r: g for g, ranks in enumerate(self.groups) for r in ranks}

    def group_of(self, rank: int) -> int | None:
        """The engine group of ``rank``; None for trainer ranks."""
        return self._group_of.get(rank)

    def sender(self, group: int) -> int:
        return self.trainers[group % len(self.trainers)]

    def data_members(self, group: int) -> tuple[int, ...]:
        return (self.sender(group),) + self.groups[group]

    def control_members(self, group: int) -> tuple[int, ...]:
        return self.trainers + self.groups[group]

    def subgroups(self) -> dict[str, list[int]]:
        """Every member builds ``SyncGroup`` with this same dict, in this order."""
        out: dict[str, list[int]] = {}
        for g in range(len(self.groups)):
            out[f"data{g}"] = list(self.data_members(g))
            out[f"ctrl{g}"] = list(self.control_members(g))
        return out

    def describe(self) -> dict:
        return {"world_size": self.world_size, "trainers": list(self.trainers),
                "engine_groups": [list(g) for g in self.groups]}


def partition(world_size: int, *, trainer_ranks: int = 1, group_size: int | None = None,
              group_sizes: Sequence[int] | None = None) -> BenchLayout:
    """Trainer ranks first, then engine groups: all of size ``group_size``, or ``group_sizes``.

    Raises ``ValueError`` when the groups do not cover every non-trainer rank exactly once.
    """
    if trainer_ranks < 1:
        raise ValueError(f"--trainer-ranks must be at least 1, got {trainer_ranks}")
    engines = world_size - trainer_ranks
    if engines < 1:
        raise ValueError(f"a world of {world_size} rank(s) with {trainer_ranks} trainer rank(s) "
                         f"leaves no engine rank; raise --nproc or lower --trainer-ranks")
    if (group_size is None) == (group_sizes is None):
        raise ValueError("give exactly one of --engine-group-size and --engine-group-sizes")
    if group_size is not None:
        if group_size < 1 or engines % group_size:
            raise ValueError(f"{engines} engine ranks ({trainer_ranks}..{world_size - 1}) cannot be "
                             f"split into groups of {group_size}; pick a divisor of {engines} or "
                             f"list the sizes with --engine-group-sizes")
        sizes = [group_size] * (engines // group_size)
    else:
        sizes = list(group_sizes or ())
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"--engine-group-sizes must list positive sizes, got {sizes}")
        if sum(sizes) != engines:
            first = trainer_ranks + sum(sizes)
            what = (f"{_ranks(first, world_size - 1)} in no group" if sum(sizes) < engines
                    else f"they name {sum(sizes) - engines} rank(s) beyond the last rank {world_size - 1}")
            raise ValueError(f"--engine-group-sizes {','.join(map(str, sizes))} covers {sum(sizes)} "
                             f"engine ranks but the world has {engines} ({trainer_ranks}.."
                             f"{world_size - 1}): {what}")
    groups, start = [], trainer_ranks
    for s in sizes:
        groups.append(tuple(range(start, start + s)))
        start += s
    return BenchLayout(world_size, tuple(range(trainer_ranks)), tuple(groups))


def _ranks(first: int, last: int) -> str:
    return f"rank {first} is" if first == last else f"ranks {first}..{last} are"
