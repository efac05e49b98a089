"""Store values a peer acts on, sealed with the sync's shared secret: a value is the JSON of a
pydantic message, signed and bound to its key (so another client of the store cannot write
one, and a value cannot be replayed under another key).  Nothing read here is unpickled."""

from __future__ import annotations

import datetime
import time
from typing import TypeVar

import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from shardsync.store import auth
from shardsync.store.liveness import Watch, wait

M = TypeVar("M", bound=BaseModel)


class Signed(BaseModel):
    """A store value written by a holder of the sync's secret: ``body`` is the JSON message."""

    model_config = ConfigDict(extra="forbid")

    body: str
    mac: str


def seal(key: str, body: str, secret: str) -> str:
    """The store value for ``body`` under ``key``, signed."""
    return Signed(body=body, mac=auth.mac(secret, key, body)).model_dump_json()


def unseal(key: str, raw: bytes | str, secret: str) -> str:
    """The JSON body of a store value; a ``ValueError`` if it is not signed with ``secret`` (some
    other client of the store wrote it)."""
    try:
        signed = Signed.model_validate_json(raw)
    except ValueError:
        raise ValueError(f"store value under {key} is not signed: refused (only holders of the "
                         "sync's token write control values)") from None
    if not auth.verify_mac(secret, key, signed.body, signed.mac):
        raise ValueError(f"store value under {key} has a wrong signature: refused")
    return signed.body


def put(store: dist.Store, key: str, msg: BaseModel, secret: str) -> None:
    store.set(key, seal(key, msg.model_dump_json(), secret))


def get(store: dist.Store, key: str, model: type[M], timeout: datetime.timedelta,
        secret: str, watch: Watch | None = None) -> M:
    """Wait (bounded; ended early by a silent member of ``watch``) for ``key`` and validate its
    value as ``model``; never unpickles.  A value deleted between the wait and the read (another
    client of the store) reads as empty: that is no answer yet, waited for within the same bound."""
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        wait(store, [key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())), watch)
        raw = store.get(key)
        if raw:
            return model.model_validate_json(unseal(key, raw, secret))
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(f"the value under {key} was deleted as it was read, until the wait's bound")
