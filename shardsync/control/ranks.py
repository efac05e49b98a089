"""Trainer ranks agreeing with each other: rank 0 decides, every rank learns the decision,
as typed JSON (never a pickle) - over the trainer's own group at connect, through the sync
group's store during updates (bounded waits)."""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from pydantic import BaseModel

from shardsync.control.client import SyncError
from shardsync.store.sealed import get, put

M = TypeVar("M", bound=BaseModel)


def _broadcast_bytes(data: bytes, *, rank: int, group) -> bytes:
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, group=group, group_src=0)
    buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == 0
           else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
    if buf.numel():
        dist.broadcast(buf, group=group, group_src=0)
    return buf.cpu().numpy().tobytes()


def share(msg: M | None, model: type[M], *, rank: int, world: int, group) -> M:
    """Rank 0's ``msg`` on every trainer rank (collective over ``group``)."""
    if world == 1:
        assert msg is not None
        return msg
    data = b""
    if rank == 0:
        assert msg is not None, "rank 0 decides: it always has the message to share"
        data = msg.model_dump_json().encode()
    return model.model_validate_json(_broadcast_bytes(data, rank=rank, group=group))


def share_json(obj, *, rank: int, world: int, group):
    """Rank 0's plain JSON value (lists, dicts, numbers, strings) on every rank."""
    if world == 1:
        return obj
    data = json.dumps(obj).encode() if rank == 0 else b""
    return json.loads(_broadcast_bytes(data, rank=rank, group=group))


def signal(store: dist.Store, key: str, msg: M | None, model: type[M], *, rank: int,
           world: int, timeout: datetime.timedelta, secret: str) -> M:
    """Rank 0 publishes ``msg`` under ``key``; the other ranks wait for it (bounded).  A lone
    rank publishes nothing (no store round trip on its update's path)."""
    if rank == 0:
        assert msg is not None
        if world > 1:
            put(store, key, msg, secret)
        return msg
    try:
        return get(store, key, model, timeout, secret)
    except dist.DistStoreError:
        raise SyncError(f"no word from trainer rank 0 under {key} within {timeout.total_seconds():g}s "
                        "(rank 0 gone or stuck)") from None


def gather(store: dist.Store, key: str, msg: M, model: type[M], *, rank: int, world: int,
           timeout: datetime.timedelta, secret: str) -> list[M]:
    """Every trainer rank's ``msg`` (under ``key/<rank>``), on every rank."""
    put(store, f"{key}/{rank}", msg, secret)
    return [get(store, f"{key}/{r}", model, timeout, secret) for r in range(world)]


@dataclass(frozen=True)
class TrainerRanks:
    """One trainer rank among its peers: the helpers above with who it is, the trainer's group,
    the wait bound and the shared secret filled in."""

    rank: int
    world: int
    group: Any  # the trainer's process group (None: a lone rank)
    timeout: datetime.timedelta
    secret: str = field(repr=False)

    def share(self, msg: M | None, model: type[M]) -> M:
        return share(msg, model, rank=self.rank, world=self.world, group=self.group)

    def signal(self, store: dist.Store, key: str, msg: M | None, model: type[M]) -> M:
        return signal(store, key, msg, model, rank=self.rank, world=self.world, timeout=self.timeout,
                      secret=self.secret)

    def gather(self, store: dist.Store, key: str, msg: M, model: type[M]) -> list[M]:
        return gather(store, key, msg, model, rank=self.rank, world=self.world, timeout=self.timeout,
                      secret=self.secret)

    def lead(self, fn: Callable[[], M], model: Callable[..., M]) -> M | None:
        """``fn()`` on rank 0, its exception as ``model(error=...)``; None on the other ranks."""
        if self.rank != 0:
            return None
        try:
            return fn()
        except Exception as e:
            return model(error=f"{type(e).__name__}: {e}")
