"""What the model tests share: relative error, a rank's shards placed in HF tensors, and the
TP 1 trainer run every parallel world is compared with."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shardsync.layout import Layout, MegatronParallel
from shardsync.plan.local import region


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0/0 counts as 0)."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def to_hf(layout: Layout, rank: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Place one rank's local tensors into full HF-shaped tensors (what its pieces cover)."""
    full: dict[str, torch.Tensor] = {}
    for p in layout.ranks[rank].pieces:
        t = full.setdefault(p.logical, torch.zeros(layout.logical[p.logical]))
        t[region(p.offsets, p.sizes)] = tensors[p.local][region(p.local_offsets, p.sizes)]
    return full


def tp1_reference(spec, batch: Callable[[int, int], tuple], dp: int, *, seed: int, optim) -> dict[str, Any]:
    """The TP 1 / PP 1 trainer doing what a DP ``dp`` world does (the mean of the replicas'
    losses): their losses, its logits of replica 0's rows, HF-shaped gradients, grad norm and
    post-step parameters.  ``batch(d, dp)`` is replica ``d``'s (ids, loss_fn)."""
    from shardsync.models.trainer import TrainerModel
    from shardsync.models.weights import random_source

    model = TrainerModel(spec, MegatronParallel(), source=random_source(spec, seed), optim=optim)
    logits = model.logits(batch(0, 1)[0])
    losses = []
    for d in range(dp):
        ids, loss_fn = batch(d, dp)
        losses.append(dp * model.forward_backward(ids, lambda lp, f=loss_fn: f(lp) / dp))
    model.finish_grad_sync()
    grads = to_hf(model.layout, 0, {n: p.grad for n, p in model.named_parameters()})
    norm = model.optimizer_step()
    params = to_hf(model.layout, 0, {n: p.detach() for n, p in model.named_parameters()})
    return {"logits": logits, "losses": losses, "grads": grads, "norm": norm, "params": params, "model": model}
