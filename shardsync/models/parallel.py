"""Megatron-style parallel primitives of the reference trainer (gloo or NCCL groups).

``megatron_groups`` builds one model's TP/PP/DP groups in Megatron rank order; ``Comm``
wraps one group's collectives with a timeout and carries Megatron's two TP autograd
functions (``mappings.py``: copy-to / reduce-from the TP region) and the vocab-parallel
target log-probability (``cross_entropy.py``), re-derived here, not copied.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel


@dataclass(frozen=True)
class TrainerGroups:
    """The calling process's rank in the model and its TP/PP/DP groups (None when size 1)."""

    rank: int | None
    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None


def megatron_groups(par: MegatronParallel, *, first_rank: int = 0,
                    timeout_s: float = 60.0) -> TrainerGroups:
    """Create the TP, PP and DP groups of a model on default-group ranks
    ``[first_rank, first_rank + par.world_size)`` (Megatron rank order: TP fastest, then DP,
    then PP).

    Collective over the default group: every process of it calls this with the same
    arguments, in the same order as its other ``new_group`` calls, member or not.  Groups of
    size 1 are not created.  Processes outside the model get ``rank=None``.
    """
    me = dist.get_rank() - first_rank
    mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "pp": None, "dp": None}
    timeout = datetime.timedelta(seconds=timeout_s)
    ranks = range(par.world_size)
    keys = {"tp": lambda g: par.coords(g)[:2], "pp": lambda g: par.coords(g)[1:],
            "dp": lambda g: (par.coords(g)[0], par.coords(g)[2])}
    for kind, size in (("tp", par.tp), ("pp", par.pp), ("dp", par.dp)):
        if size == 1:
            continue
        buckets: dict[tuple[int, int], list[int]] = {}
        for g in ranks:
            buckets.setdefault(keys[kind](g), []).append(g)
        for members in buckets.values():
            group = dist.new_group([first_rank + g for g in members], timeout=timeout)
            if me in members:
                mine[kind] = group
    return TrainerGroups(me if 0 <= me < par.world_size else None, **mine)


class Comm:
    """One process group's collectives with the model's timeout; no-ops at size 1."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 timeout: datetime.timedelta) -> None:
        self.group, self.rank, self.size, self.timeout = group, rank, size, timeout

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, op=op, group=self.group, async_op=True).wait(self.timeout)
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group, async_op=True).wait(self.timeout)
        return parts

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, group=self.group, group_src=src, async_op=True).wait(self.timeout)
        return x

    def send(self, x: torch.Tensor, peer: int) -> None:
        dist.isend(x.contiguous(), group=self.group, group_dst=peer).wait(self.timeout)

    def recv(self, x: torch.Tensor, peer: int) -> torch.Tensor:
        dist.irecv(x, group=self.group, group_src=peer).wait(self.timeout)
        return x

    def exchange(self, x: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``x`` to ``peer`` and receive its tensor of the same shape (both call this)."""
        other = torch.empty_like(x)
        works = [dist.isend(x.contiguous(), group=self.group, group_dst=peer),
                 dist.irecv(other, group=self.group, group_src=peer)]
        for w in works:
            w.wait(self.timeout)
        return other

    # Megatron's two TP autograd functions (mappings.py), as methods.
    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce backward: input of a column-parallel op."""
        return _CopyToTP.apply(x, self) if self.size > 1 else x

    def reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce forward, identity backward: output of a row-parallel op."""
        return _ReduceFromTP.apply(x, self) if self.size > 1 else x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_reduce(grad.contiguous().clone()), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class VocabParallelLogprob(torch.autograd.Function):
    """log softmax(logits)[target] from a vocab shard ``[..., P]`` (fp32, padding = -inf)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int,
                comm: Comm) -> torch.Tensor:
        top = comm.all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX)
        shifted = logits - top[..., None]
        local = targets - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        picked = shifted.gather(-1, index[..., None]).squeeze(-1)
        picked = comm.all_reduce(torch.where(inside, picked, torch.zeros_like(picked)))
        exp = shifted.exp()
        total = comm.all_reduce(exp.sum(dim=-1))
        ctx.save_for_backward(exp.div_(total[..., None]), index, inside)
        return picked - total.log()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, index, inside = ctx.saved_tensors
        out = softmax * -grad[..., None]
        out.scatter_add_(-1, index[..., None], torch.where(inside, grad, 0.0)[..., None])
        return out, None, None, None


def check_group(group: dist.ProcessGroup | None, kind: str, coord: int,
                 size: int) -> dist.ProcessGroup | None:
    if size == 1:
        return None
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{kind}={size} needs a {kind}_group (megatron_groups makes them)")
    if dist.get_world_size(group) != size or dist.get_rank(group) != coord:
        raise ValueError(
            f"{kind}_group has rank {dist.get_rank(group)} of {dist.get_world_size(group)}; "
            f"this rank's {kind} coordinate is {coord} of {size} (Megatron rank order)")
    return group
