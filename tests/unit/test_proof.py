"""Pure parts of the group proof (``transport/proof.py``) and of signed rendezvous values
(``store/signed.py``)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardsync.store.signed import ForgedValue, SignedStore, sign, verify
from shardsync.transport.proof import partners, rounds, tag


@pytest.mark.parametrize("size", range(1, 10))
def test_rounds_meet_every_pair_once_in_matchings(size: int) -> None:
    rs = rounds(size)
    pairs = [p for r in rs for p in r]
    assert sorted(pairs) == [(a, b) for a in range(size) for b in range(a + 1, size)]  # each pair once
    assert all(len({m for p in r for m in p}) == 2 * len(r) for r in rs)  # nobody twice in a round
    assert len(rs) <= size  # n - 1 rounds, n when odd: the proof's latency grows linearly
    for m in range(size):
        assert sorted(partners(size, m)) == [p for p in range(size) if p != m]


def test_tags_differ_by_direction_connection_and_secret() -> None:
    base = tag("s" * 24, "c/world", 0, 1)
    assert base == tag("s" * 24, "c/world", 0, 1)
    assert len({base, tag("s" * 24, "c/world", 1, 0), tag("s" * 24, "d/world", 0, 1),
                tag("t" * 24, "c/world", 0, 1), tag("s" * 24, "c/stage0", 0, 1)}) == 5


def test_signed_values_are_bound_to_key_and_secret() -> None:
    raw = sign("s" * 24, "n/world/0/1", b"\x02addr")
    assert verify("s" * 24, "n/world/0/1", raw) == b"\x02addr"
    for key, secret, value in (("n/world/0/0", "s" * 24, raw), ("n/world/0/1", "t" * 24, raw),
                               ("n/world/0/1", "s" * 24, raw[:-1] + b"X"), ("n/world/0/1", "s" * 24, b"short")):
        with pytest.raises(ForgedValue, match="is not signed with the sync's secret"):
            verify(secret, key, value)


def test_signed_store_signs_what_process_groups_write() -> None:
    """Through a PrefixStore, as torch's process groups reach it (C++ calling the Python view)."""
    inner = dist.HashStore()
    signed = SignedStore(inner, "s" * 24)
    view = dist.PrefixStore("conn", signed)
    view.set("world/0/1", "addr")
    assert inner.get("conn/world/0/1") == sign("s" * 24, "conn/world/0/1", b"addr")
    assert view.get("world/0/1") == b"addr"
    signed.multi_set(["a", "b"], [b"1", b"2"])
    assert signed.clone().multi_get(["a", "b"]) == [b"1", b"2"]
    assert view.add("count", 2) == 2  # counters stay plain
    inner.set("conn/world/0/1", b"a rogue's address")
    with pytest.raises(ForgedValue, match="'conn/world/0/1' is not signed"):
        view.get("world/0/1")
