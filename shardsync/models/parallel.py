"""Megatron-style parallel primitives of the reference trainer (gloo or NCCL groups).

``megatron_groups`` builds one model's TP/PP/DP (and expert) groups in Megatron rank order;
``Comm`` wraps one group's collectives with a timeout and carries Megatron's two TP autograd
functions (``mappings.py``: copy-to / reduce-from the TP region) and the vocab-parallel
target log-probability (``cross_entropy.py``), re-derived here, not copied; ``ExpertExchange``
moves tokens to and from the expert group (an all-gather dispatcher).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel


@dataclass(frozen=True)
class TrainerGroups:
    """The calling process's rank in the model and its TP/PP/DP groups (None when size 1);
    for mixture-of-experts models also its expert group (ETP x EP ranks sharing one copy of
    every expert) and expert-DP group (the copies of its experts)."""

    rank: int | None
    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    expert: dist.ProcessGroup | None = None
    expert_dp: dist.ProcessGroup | None = None


def expert_group_ranks(par: MegatronParallel, rank: int) -> list[int]:
    """The ranks of ``rank``'s expert group, in group order (same stage and expert-DP rank)."""
    pp, edp, _, _ = par.expert_coords(rank)
    size = par.expert_tp * par.ep
    base = pp * par.tp * par.dp + edp * size
    return list(range(base, base + size))


def megatron_groups(par: MegatronParallel, *, first_rank: int = 0,
                    timeout_s: float = 60.0, moe: bool = False) -> TrainerGroups:
    """Create the TP, PP and DP groups of a model on default-group ranks
    ``[first_rank, first_rank + par.world_size)`` (Megatron rank order: TP fastest, then DP,
    then PP).

    ``moe``: also the expert and expert-DP groups.  Collective over the default group: every
    process of it calls this with the same arguments, in the same order as its other
    ``new_group`` calls, member or not.  Groups of size 1 are not created.  Processes outside
    the model get ``rank=None``.
    """
    me = dist.get_rank() - first_rank
    mine: dict[str, dist.ProcessGroup | None] = {"tp": None, "pp": None, "dp": None, "expert": None,
                                                 "expert_dp": None}
    timeout = datetime.timedelta(seconds=timeout_s)
    ranks = range(par.world_size)
    keys = {"tp": lambda g: par.coords(g)[:2], "pp": lambda g: par.coords(g)[1:],
            "dp": lambda g: (par.coords(g)[0], par.coords(g)[2]),
            "expert": lambda g: par.expert_coords(g)[:2],
            "expert_dp": lambda g: (par.expert_coords(g)[0], *par.expert_coords(g)[2:])}
    sizes = [("tp", par.tp), ("pp", par.pp), ("dp", par.dp)]
    if moe:
        sizes += [("expert", par.expert_tp * par.ep), ("expert_dp", par.expert_dp)]
    for kind, size in sizes:
        if size == 1:
            continue
        buckets: dict[tuple[int, ...], list[int]] = {}
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

    # isend/irecv return None only to a rank outside the group; a Comm is its group's member
    def send(self, x: torch.Tensor, peer: int) -> None:
        cast(dist.Work, dist.isend(x.contiguous(), group=self.group, group_dst=peer)).wait(self.timeout)

    def recv(self, x: torch.Tensor, peer: int) -> torch.Tensor:
        cast(dist.Work, dist.irecv(x, group=self.group, group_src=peer)).wait(self.timeout)
        return x

    def exchange(self, x: torch.Tensor, peer: int) -> torch.Tensor:
        """Send ``x`` to ``peer`` and receive its tensor of the same shape (both call this)."""
        other = torch.empty_like(x)
        works = [dist.isend(x.contiguous(), group=self.group, group_dst=peer),
                 dist.irecv(other, group=self.group, group_src=peer)]
        for w in cast(list[dist.Work], works):
            w.wait(self.timeout)
        return other

    # Megatron's two TP autograd functions (mappings.py), as methods.
    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce backward: input of a column-parallel op."""
        return _CopyToTP.apply(x, self) if self.size > 1 else x

    def reduce_from(self, x: torch.Tensor) -> torch.Tensor:
        """All-reduce forward, identity backward: output of a row-parallel op."""
        return _ReduceFromTP.apply(x, self) if self.size > 1 else x

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather along the last dim forward, this rank's slice backward: the output of a
        column-parallel op with ``gather_output`` (megatron-core's local-spec MLA down projections)."""
        return _GatherLastTP.apply(x, self) if self.size > 1 else x


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


class _GatherLastTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm, ctx.width = comm, x.shape[-1]
        return torch.cat(comm.all_gather(x.contiguous()), dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        lo = ctx.comm.rank * ctx.width
        return grad[..., lo:lo + ctx.width].contiguous(), None


class ExpertExchange:
    """Tokens to and from an expert group whose ranks may hold different tokens (EP over DP)
    or the same ones (TP peers): ``gather`` concatenates every member's rows, ``combine``
    sums every member's partial expert outputs and returns the caller's rows.

    The gradients are those of each distinct batch computed once: a batch that ``m`` members
    share reaches the experts ``m`` times, each copy's gradient scaled by ``1/m`` on the way
    back from ``combine`` and by ``m`` on the way back to the caller's activations.
    """

    def __init__(self, comm: Comm, shares: list[int]) -> None:
        self.comm, self.shares = comm, shares  # shares[i]: members holding member i's tokens

    def rows(self, n: int) -> list[int]:
        if self.comm.size == 1:
            return [n]
        counts = self.comm.all_gather(torch.tensor([n], dtype=torch.int64))
        return [int(c) for c in counts]

    def gather(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return _Gather.apply(x, self, rows) if self.comm.size > 1 else x

    def gather_ids(self, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return _gather_rows(self.comm, x, rows) if self.comm.size > 1 else x

    def combine(self, partial: torch.Tensor, rows: list[int]) -> torch.Tensor:
        return _Combine.apply(partial, self, rows) if self.comm.size > 1 else partial


def _gather_rows(comm: Comm, x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Every member's ``x`` (``rows[i]`` rows each, padded to the longest for the collective)."""
    top = max(rows)
    pad = torch.zeros((top, *x.shape[1:]), dtype=x.dtype, device=x.device)
    pad[:x.shape[0]] = x
    return torch.cat([p[:n] for p, n in zip(comm.all_gather(pad), rows, strict=True)])


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, ex: ExpertExchange, rows: list[int]) -> torch.Tensor:
        ctx.ex, ctx.rows = ex, rows
        return _gather_rows(ex.comm, x.detach(), rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ex, rows = ctx.ex, ctx.rows
        total = ex.comm.all_reduce(grad.contiguous().clone())
        start = sum(rows[:ex.comm.rank])
        return total[start:start + rows[ex.comm.rank]] * ex.shares[ex.comm.rank], None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial: torch.Tensor, ex: ExpertExchange, rows: list[int]) -> torch.Tensor:
        ctx.ex, ctx.rows = ex, rows
        total = ex.comm.all_reduce(partial.detach().contiguous().clone())
        start = sum(rows[:ex.comm.rank])
        return total[start:start + rows[ex.comm.rank]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ex, rows = ctx.ex, ctx.rows
        full = _gather_rows(ex.comm, grad.contiguous(), rows)
        scale = torch.cat([torch.full((n,), 1.0 / m, dtype=full.dtype, device=full.device)
                           for n, m in zip(rows, ex.shares, strict=True)])
        return full * scale[:, None], None, None


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
