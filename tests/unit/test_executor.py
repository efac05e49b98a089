"""The one executor with message digests: clean runs are unchanged, a byte corrupted on the
way fails the receive before anything is unpacked (in-process loopback, no processes)."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.plan.local import execute_local
from shardsync.presets import PRESETS
from shardsync.runtime.executor import BufferPool, CorruptBucket, digest, execute
from shardsync.runtime.schedule import p2p_steps
from shardsync.topology import Topology
from tests.unit.test_paths import Loopback


class CorruptingLoopback(Loopback):
    """Flips one byte of the ``nth`` data message this rank sends (a bad link)."""

    def __init__(self, me: int, mail: dict, nth: int) -> None:
        super().__init__(me, mail)
        self.sent, self.nth = 0, nth

    def send(self, buf, peer):
        work = super().send(buf, peer)
        if buf.dtype != torch.int64:  # a data message, not its digest
            if self.sent == self.nth:
                bad = self.mail[(self.me, peer)][-1]
                bad.view(torch.uint8)[3] ^= 0x10
            self.sent += 1
        return work


def _world():
    topo = Topology(PRESETS["tiny-qwen3"], MegatronParallel(tp=2), (EngineParallel(tp=2),))
    src = random_source(topo.spec, seed=5)
    trainer = [load_rank(topo.trainer_layout, r, src) for r in range(2)]
    engine = [load_rank(topo.engine_layouts[0], r, random_source(topo.spec, seed=9)) for r in range(2)]
    return topo, trainer, engine


def test_digest_sees_every_word_and_any_width() -> None:
    for n, dtype in ((12, torch.float32), (7, torch.bfloat16), (5, torch.uint8)):
        t = torch.arange(n, dtype=torch.float32).to(dtype)
        d = int(digest(t).item())
        t.view(torch.uint8)[-1] ^= 1
        assert int(digest(t).item()) != d, dtype


@pytest.mark.parametrize("corrupt", [None, 0, 5])
def test_verified_messages_land_or_fail_before_unpacking(corrupt) -> None:
    topo, trainer, engine = _world()
    mail: dict = defaultdict(deque)
    for r in range(2):
        transport = Loopback(r, mail) if corrupt is None or r != 1 else CorruptingLoopback(r, mail, corrupt)
        execute(p2p_steps(topo, r, 4096), trainer[r], transport, pool=BufferPool(torch.float32), verify=True)
    before = [{k: v.clone() for k, v in e.items()} for e in engine]
    expect = execute_local(topo.p2p_plan, trainer)
    errors = []
    for e in range(2):
        try:
            execute(p2p_steps(topo, 2 + e, 4096), engine[e], Loopback(2 + e, mail),
                    pool=BufferPool(torch.float32), verify=True, credits=1)
        except CorruptBucket as err:
            errors.append(str(err))
    if corrupt is None:
        assert errors == []
        assert all(torch.equal(expect[e][k], engine[e][k]) for e in range(2) for k in engine[e])
        return
    assert len(errors) == 1 and "arrived corrupted" in errors[0] and "from sync rank 1" in errors[0]
    # nothing of the corrupted bucket landed: every element holds its old or its new value
    for e in range(2):
        for k in engine[e]:
            ok = (engine[e][k] == before[e][k]) | (engine[e][k] == expect[e][k])
            assert bool(ok.all()), (e, k)
    assert any(not torch.equal(expect[e][k], engine[e][k]) for e in range(2) for k in engine[e])
