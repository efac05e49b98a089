"""The LoRA flags of the command line (``engine serve``, ``plan``), spelled once:
``--lora-rank R [--lora-alpha A] [--lora-targets q_proj,v_proj]``."""

from __future__ import annotations

import argparse

from shardsync.lora.config import ALL_LINEAR, Lora
from shardsync.lora.table import TARGETS


def add_lora_args(p: argparse.ArgumentParser, rank_help: str) -> None:
    p.add_argument("--lora-rank", type=int, default=0, metavar="R", help=rank_help)
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: twice the rank)")
    p.add_argument("--lora-targets", default=",".join(ALL_LINEAR),
                   help=f"modules the adapter targets, comma-separated (PEFT's target_modules; of "
                        f"{', '.join(TARGETS)})")


def lora_of(args: argparse.Namespace) -> Lora | None:
    """The adapter the flags name, or None (``--lora-rank 0``, the default)."""
    if not args.lora_rank:
        return None
    alpha = args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank
    return Lora(args.lora_rank, alpha, tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))


def lora_flags(lora: Lora | None, *, merge: bool = False) -> list[str]:
    """``lora_of``'s inverse: the flags that name ``lora`` (none for None), for a command line
    that starts another process with the same adapter; ``merge``: an engine that merges it into
    its base (``--lora-merge``, meaningless without an adapter)."""
    if lora is None:
        return []
    return (["--lora-rank", str(lora.rank), "--lora-alpha", repr(lora.alpha), "--lora-targets", ",".join(lora.targets)]
            + ["--lora-merge"] * merge)
