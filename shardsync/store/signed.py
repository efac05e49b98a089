"""The store the sync's process groups meet in, signing every value they write.

gloo writes each member's listening address there and NCCL its unique id: another local
user who can reach the TCPStore could otherwise overwrite them and stand in as a peer.
Here every value carries an HMAC of its key and bytes under the sync's secret, and a value
that does not is refused when it is read, naming the key, before anything connects to it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac

import torch.distributed as dist

_TAG = b"shardsync-group-value\0"
_MAC = hashlib.sha256().digest_size


class ForgedValue(ValueError):
    """A store value that no holder of the sync's secret wrote."""


def sign(secret: str, key: str, value: bytes) -> bytes:
    return hmac.new(secret.encode(), _TAG + key.encode() + b"\0" + value, hashlib.sha256).digest() + value


def verify(secret: str, key: str, raw: bytes) -> bytes:
    """The value signed under ``key``; a ``ForgedValue`` if its signature is not the secret's."""
    mac, value = raw[:_MAC], raw[_MAC:]
    good = hmac.new(secret.encode(), _TAG + key.encode() + b"\0" + value, hashlib.sha256).digest()
    if len(raw) < _MAC or not hmac.compare_digest(mac, good):
        raise ForgedValue(f"the sync store's value under {key!r} is not signed with the sync's secret: another "
                          "local process wrote it (a rogue peer address?); the group is not formed with it")
    return value


class SignedStore(dist.Store):
    """A view of ``inner`` for process-group rendezvous: values signed on ``set``, checked on
    ``get``.  Counters (``add``) stay as they are: a forged count can only stall a barrier,
    which the group's timeout ends.

    torch calls these methods from C++ through a trampoline that finds them on this Python
    object, so the owner must keep it alive as long as any process group built on it.
    """

    def __init__(self, inner: dist.Store, secret: str) -> None:
        super().__init__()
        self._inner, self._secret = inner, secret
        self._clones: list[SignedStore] = []  # alive as long as this view (see above)

    def set(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self._inner.set(key, sign(self._secret, key, raw))  # type: ignore[arg-type]  # bytes pass; stubs say str

    def get(self, key: str) -> bytes:
        return verify(self._secret, key, bytes(self._inner.get(key)))

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        signed = [sign(self._secret, k, bytes(v)) for k, v in zip(keys, values, strict=True)]
        self._inner.multi_set(keys, signed)  # type: ignore[attr-defined]  # missing in torch's stubs

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [verify(self._secret, k, bytes(v)) for k, v in zip(keys, self._inner.multi_get(keys), strict=True)]

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        raise NotImplementedError(f"compare_set({key!r}) on a signed group store: no process group "
                                  "shardsync builds uses it")

    def add(self, key: str, amount: int) -> int:
        return self._inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        if timeout is None:
            self._inner.wait(keys)
        else:
            self._inner.wait(keys, timeout)

    def deleteKey(self, key: str) -> bool:  # noqa: N802 (the name torch's trampoline looks up)
        return self._inner.delete_key(key)

    def getNumKeys(self) -> int:  # noqa: N802 (as above)
        return self._inner.num_keys()

    def clone(self) -> SignedStore:
        twin = SignedStore(self._inner.clone(), self._secret)  # type: ignore[attr-defined]  # as above
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        return True
