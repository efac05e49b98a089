"""The verifiable task: answer with low token ids.  Reward = share of generated tokens whose
id is below ``vocab // 4`` (25 % for a random policy), checkable by a rule."""

from __future__ import annotations

import torch


def make_prompts(step: int, n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def reward(tokens: list[int], vocab: int) -> float:
    if not tokens:
        return 0.0
    return sum(t < vocab // 4 for t in tokens) / len(tokens)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: reward minus its group's mean, over the group's std (groups are consecutive)."""
    r = rewards.view(-1, group)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6)
    return adv.reshape(-1)
