"""A sweep: the cartesian product of the lists in a ``BenchConfig`` (pure)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from shardsync.bench.policy import POLICIES
from shardsync.bench.workload import TRANSPORTS

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything one ``shardsync bench`` run needs; list fields are sweep axes."""

    nproc: int | None = None  # None: 5 when spawning, WORLD_SIZE under torchrun
    trainer_ranks: int = 1
    engine_group_size: int | None = None
    engine_group_sizes: tuple[int, ...] | None = None
    transports: tuple[str, ...] = ("broadcast", "p2p")
    bucket_mb: tuple[float, ...] = (1.0,)
    messages: int = 4
    credits: tuple[int, ...] = (2,)
    inflight_mb: tuple[float | None, ...] = (None,)
    policies: tuple[str, ...] = POLICIES
    windows: tuple[int, ...] = (2,)
    stride_us: tuple[float, ...] = (0.0,)
    reuse: tuple[bool, ...] = (True,)
    warmup: int = 2
    iters: int = 10
    model: str | None = None
    trainer_tp: int | None = None
    engine_tp: int | None = None
    device: str = "auto"
    timeout_s: float = 60.0
    trace: bool = False
    out: str | None = None
    plots: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for name, values, allowed in (("transport", self.transports, TRANSPORTS),
                                      ("policy", self.policies, POLICIES)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"--{name} {','.join(values)}: use a comma list of {', '.join(allowed)}")
        axes: tuple[tuple[str, tuple[object, ...]], ...] = (
            ("bucket-mb", self.bucket_mb), ("credits", self.credits), ("window", self.windows),
            ("stride-us", self.stride_us), ("reuse", self.reuse), ("inflight-mb", self.inflight_mb))
        for name, axis in axes:
            if not axis:
                raise ValueError(f"--{name} needs at least one value")
        if any(b <= 0 for b in self.bucket_mb):
            raise ValueError(f"--bucket-mb values must be > 0, got {self.bucket_mb}")
        if any(c is not None and c <= 0 for c in self.inflight_mb):
            raise ValueError(f"--inflight-mb values must be > 0 (or 'none'), got {self.inflight_mb}")
        if self.iters < 1 or self.warmup < 0 or self.messages < 1:
            raise ValueError(f"need --iters >= 1, --warmup >= 0 and --messages >= 1, got "
                             f"{self.iters}, {self.warmup}, {self.messages}")


@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    transport: str
    bucket_bytes: int
    credits: int
    inflight_cap_bytes: int | None
    policy: str
    window: int | None
    stride_s: float
    reuse: bool

    def label(self) -> str:
        pol = f"windowed(W={self.window})" if self.policy == "windowed" else self.policy
        cap = "" if self.inflight_cap_bytes is None else f"/{self.inflight_cap_bytes / MiB:g}MiB"
        return (f"{self.transport} {self.bucket_bytes / MiB:g}MiB c{self.credits}{cap} {pol} "
                f"stride {self.stride_s * 1e6:g}us reuse {'on' if self.reuse else 'off'}")


def expand(cfg: BenchConfig) -> list[Point]:
    """Cartesian product of the axes; ``--window`` multiplies only the windowed policy."""
    out = []
    for t, mb, c, cap, pol, stride, reuse in itertools.product(
            cfg.transports, cfg.bucket_mb, cfg.credits, cfg.inflight_mb, cfg.policies,
            cfg.stride_us, cfg.reuse):
        for w in (cfg.windows if pol == "windowed" else (None,)):
            out.append(Point(t, int(mb * MiB), c, None if cap is None else int(cap * MiB), pol, w,
                             stride * 1e-6, reuse))
    return out
