"""Building a big model's layouts and plans allocates ~10^6 small acyclic objects; Python's
cyclic collector would scan them again and again (2-3x the build time for Qwen3-30B-A3B,
``benchmarks/plan_build.py``).  Pausing it while they are built frees nothing less."""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with the cyclic garbage collector off (restored after, nesting-safe)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return wrapper
