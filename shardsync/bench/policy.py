"""Engine-wave policies: which engine groups are updated together, and when each starts.

A policy is a pure function of the number of groups: it returns the waves (a wave's
groups are updated concurrently; wave ``k+1`` starts when every group of wave ``k`` is
done) and so the bound on concurrently active groups, which the bench then checks
against what it observes.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("all_at_once", "windowed", "serialized")


@dataclass(frozen=True)
class WavePlan:
    """Waves of engine groups; within a wave, group ``i`` starts ``i * stride_s`` late."""

    policy: str
    waves: tuple[tuple[int, ...], ...]
    stride_s: float = 0.0
    window: int | None = None

    @property
    def bound(self) -> int:
        """At most this many engine groups are active at any time."""
        return max((len(w) for w in self.waves), default=0)

    def offsets(self) -> dict[int, float]:
        """Start delay of each group after its wave starts."""
        return {g: i * self.stride_s for w in self.waves for i, g in enumerate(w)}

    def describe(self) -> str:
        return f"windowed(W={self.window})" if self.policy == "windowed" else self.policy


def plan_waves(policy: str, num_groups: int, *, window: int | None = None,
               stride_s: float = 0.0) -> WavePlan:
    """``all_at_once``: one wave; ``windowed``: waves of ``window``; ``serialized``: waves of one."""
    if num_groups < 1:
        raise ValueError(f"need at least one engine group, got {num_groups}")
    if stride_s < 0:
        raise ValueError(f"stride must be >= 0, got {stride_s * 1e6:g} us")
    if policy == "all_at_once":
        size = num_groups
    elif policy == "serialized":
        size = 1
    elif policy == "windowed":
        if window is None or window < 1:
            raise ValueError(f"windowed needs --window W >= 1, got {window}")
        size = window
    else:
        raise ValueError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    groups = list(range(num_groups))
    waves = tuple(tuple(groups[i:i + size]) for i in range(0, num_groups, size))
    return WavePlan(policy, waves, stride_s, window if policy == "windowed" else None)
