"""Launchers that place shardsync's processes on a cluster manager (Ray).

``shardsync demo`` without ``--launcher`` needs none of this: it starts every process on
the local machine.  ``loop`` holds the per-rank training loop any launcher runs;
``shardsync.launch.ray`` (the ``ray`` extra) is the only module that imports ``ray``.
"""

from __future__ import annotations

import importlib.util
import sys

from shardsync.demo import DemoConfig
from shardsync.launch.loop import RankSite, StepResult, rollouts, trainer_rank

__all__ = ["RankSite", "StepResult", "rollouts", "run_on_ray", "trainer_rank"]


def run_on_ray(cfg: DemoConfig, **options) -> int:
    """``shardsync.launch.ray.run_ray(cfg, RayConfig(**options))``; exit code 2 with the
    install command when the ``ray`` extra is missing."""
    if importlib.util.find_spec("ray") is None:
        print("error: the Ray launcher needs ray; pip install 'shardsync[ray]' (or 'ray>=2.40')",
              file=sys.stderr)
        return 2
    from shardsync.launch.ray import RayConfig, run_ray

    return run_ray(cfg, RayConfig(**options))
