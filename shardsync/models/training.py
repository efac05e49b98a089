"""What a reference trainer's step takes and returns: AdamW's settings (``OptimConfig``), the
loss function's type (``LossFn``), one step's numbers (``StepStats``) and the token-level GRPO loss.
Both reference trainers (``models.trainer``, ``models.fsdp2_trainer``) train through them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LossFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW over the fp32 master weights.  Norm weights and biases get no weight decay."""

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclass(frozen=True)
class StepStats:
    """What one ``train_step`` returns on every rank."""

    loss: float
    grad_norm: float


def grpo_loss(logprobs: torch.Tensor, *, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, clip_low: float = 0.2, clip_high: float = 0.2) -> torch.Tensor:
    """Token-level clipped policy-gradient (GRPO/PPO) loss, masked mean over all tokens.

    ``logprobs``/``old_logprobs``/``mask`` are ``[batch, seq-1]`` (as ``policy_logprobs``
    returns); ``advantages`` is ``[batch]`` (one per sequence) or ``[batch, seq-1]``.
    ``loss = -sum(mask * min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)) / sum(mask)`` with
    ``r = exp(logprobs - old_logprobs)``.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
