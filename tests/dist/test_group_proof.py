"""Who may join a sync group (``store/signed.py``, ``transport/proof.py``), with real gloo
processes on loopback: a local process without the secret is refused at the rendezvous, and
a member in the group that cannot prove the secret is named before any byte moves."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.transport.group import SyncGroup
from shardsync.transport.proof import ProofError, prove
from tests.dist._world import free_port, run_world

SECRET = "a-test-secret-0123456789"


def _join(rank: int, port: int, secrets: list[str], out) -> None:
    """Rank 0 hosts the store; every rank joins with its own idea of the secret."""
    rdv = Rendezvous("127.0.0.1", port, len(secrets), "sync-proof", timeout_s=5)
    try:
        group = SyncGroup(rdv, rank, {"stage0": list(range(len(secrets)))}, secret=secrets[rank],
                          store=open_store(rdv, is_master=True) if rank == 0 else None)
    except Exception as e:  # the outcome is the result
        out.put((rank, f"{type(e).__name__}: {e}"))
        return
    t = torch.tensor([float(rank)])
    group.world.allreduce([t]).wait(rdv.timeout)
    group.close()
    out.put((rank, f"ok {t.item()}"))


def test_members_with_the_secret_form_the_group() -> None:
    res = run_world(_join, 3, args=(free_port(), [SECRET] * 3), timeout=60)
    assert res == {0: "ok 3.0", 1: "ok 3.0", 2: "ok 3.0"}


def test_a_process_without_the_secret_cannot_join() -> None:
    """The rogue (rank 1 here) writes its gloo address signed with a guess: rank 0 refuses to
    read it, naming the key, so nothing connects to the rogue and the group never forms."""
    res = run_world(_join, 2, args=(free_port(), [SECRET, "a-guess-" + "x" * 16]), timeout=60)
    assert res[0].startswith("ForgedValue"), res
    assert "'sync-proof/world/0/1' is not signed with the sync's secret" in res[0]
    assert not res[1].startswith("ok"), res  # the rogue is refused too (it reads rank 0's address)


def _prove(rank: int, port: int, secrets: list[str], out) -> None:
    """A plain gloo world (unsigned rendezvous: someone got in) whose members prove themselves."""
    timeout = datetime.timedelta(seconds=5)
    store = dist.TCPStore("127.0.0.1", port, len(secrets), rank == 0, timeout=timeout, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, rank, len(secrets), timeout)
    try:
        prove(pg, len(secrets), rank, context="conn-1/world", secret=secrets[rank], timeout=timeout, device=None,
              who=lambda r: f"member {r}")
        out.put((rank, "ok"))
    except ProofError as e:
        out.put((rank, str(e)))
    except RuntimeError as e:  # a peer that stopped at its own refusal: this one times out
        out.put((rank, f"timeout: {e}"[:80]))


def test_a_member_that_cannot_prove_the_secret_is_named() -> None:
    res = run_world(_prove, 4, args=(free_port(), [SECRET, SECRET, "not-the-secret-000000000", SECRET]), timeout=90)
    named = [r for r, v in res.items() if v.startswith("member 2 did not prove it holds the sync's secret")]
    assert named, res  # whoever met member 2 first names it (the others then wait on a stopped peer)
    assert res[2].startswith("member ") and "did not prove" in res[2], res  # member 2 refuses the true tags
    assert all(not v.startswith("ok") or r != 2 for r, v in res.items())


def test_proofs_bind_the_connection() -> None:
    """A tag from another connection (or another pair) proves nothing: all-true secrets but the
    members disagree on the connection name -> refused."""
    res = run_world(_prove_ctx, 2, args=(free_port(),), timeout=60)
    assert all("did not prove" in v for v in res.values()), res


def _prove_ctx(rank: int, port: int, out) -> None:
    timeout = datetime.timedelta(seconds=5)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout, wait_for_workers=False)
    pg = dist.ProcessGroupGloo(store, rank, 2, timeout)
    try:
        prove(pg, 2, rank, context=f"conn-{rank}/world", secret=SECRET, timeout=timeout, device=None,
              who=lambda r: f"member {r}")
        out.put((rank, "ok"))
    except ProofError as e:
        out.put((rank, str(e)))
