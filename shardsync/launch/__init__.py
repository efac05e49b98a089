"""Launchers that place shardsync's processes on a cluster manager (Ray).

``shardsync demo`` without ``--launcher`` needs none of this: it starts every process on
the local machine.  ``loop`` holds the per-rank training loop any launcher runs;
``shardsync.launch.ray`` (the ``ray`` extra) is the only module that imports ``ray``.
"""

from __future__ import annotations

import importlib.util

from shardsync.launch.loop import RankSite, StepResult, rollouts, trainer_rank

__all__ = ["RankSite", "StepResult", "require_ray", "rollouts", "trainer_rank"]


def require_ray() -> None:
    """Raise ``ValueError`` with the install command when the ``ray`` extra is missing."""
    if importlib.util.find_spec("ray") is None:
        raise ValueError("the Ray launcher needs ray; install it with pip install 'shardsync[ray]' "
                         "(or pip install 'ray>=2.40')")
