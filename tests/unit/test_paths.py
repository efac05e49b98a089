"""Each path's compiler, no processes: trainer and engine ranks derive matching programs from
the same code, and one executor moving them through an in-process loopback reproduces the
plan bit for bit.  Plus the registry, the typed mode and the fallback choice."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.mode import FULL, Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.paths import PATHS, choose_full, connection_modes
from shardsync.plan.local import execute_local
from shardsync.presets import PRESETS
from shardsync.runtime.executor import BufferPool, Pooled, execute
from shardsync.runtime.schedule import broadcast_steps, p2p_steps
from shardsync.topology import Topology
from shardsync.views import Host

TOPOLOGIES = {
    "tp2-tp1": (MegatronParallel(tp=2), (1,)),
    "tp1pp2-tp2": (MegatronParallel(tp=1, pp=2), (2,)),
    "dp2-2engines": (MegatronParallel(tp=1, dp=2), (2, 1)),
}


def _topo(name: str, relay: bool = False) -> Topology:
    par, engines = TOPOLOGIES[name]
    return Topology(PRESETS["tiny-qwen3"], par, tuple(EngineParallel(tp=t) for t in engines), relay=relay)


class _Work:
    def wait(self) -> None:
        return None


class Loopback(Pooled):
    """Point-to-point messages between ranks of one process: sends land in a mailbox that the
    receiving rank's steps (run later, same global order) read from."""

    def __init__(self, me: int, mail: dict) -> None:
        self.me, self.mail = me, mail

    def send(self, buf, peer):
        self.mail[(self.me, peer)].append(buf.clone())
        return _Work()

    def recv(self, buf, peer):
        buf.copy_(self.mail[(peer, self.me)].popleft())
        return _Work()

    def broadcast(self, buf, group, root):
        raise AssertionError("p2p steps never broadcast")

    def synchronize(self) -> None:
        return None


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_sends_and_receives_pair_up_in_one_global_order(name: str) -> None:
    topo = _topo(name)
    world = topo.trainer.world_size + topo.num_engine_ranks
    steps = {r: p2p_steps(topo, r, 4096) for r in range(world)}
    for r, mine in steps.items():
        for s in mine:
            kind, peer = s.comm
            back = ("recv" if kind == "send" else "send", r)
            other = [t for t in steps[peer] if t.label == s.label and t.comm == back]
            assert len(other) == 1 and other[0].numel == s.numel, (r, s.label)
    for stage in range(topo.trainer.pp):  # every engine rank receives every broadcast bucket
        per_rank = [broadcast_steps(topo, r, 4096, stage) for r in range(world)]
        labels = {tuple(s.label for s in st if s.comm and s.comm[0] == "bcast")
                  for st in per_rank[topo.trainer.world_size:]}
        assert len(labels) == 1 and labels.pop()


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_p2p_program_through_one_executor_equals_the_plan(name: str) -> None:
    topo = _topo(name)
    spec, T = topo.spec, topo.trainer.world_size
    src = random_source(spec, seed=3)
    trainer = [load_rank(topo.trainer_layout, r, src) for r in range(T)]
    engines = []
    for i, lay in enumerate(topo.engine_layouts):
        engines += [load_rank(lay, r, random_source(spec, seed=99)) for r in range(topo.engines[i].tp)]
    mail: dict = defaultdict(deque)
    for r in range(T + len(engines)):  # senders first: their messages wait in the mailbox
        local = trainer[r] if r < T else engines[r - T]
        execute(p2p_steps(topo, r, 4096), local, Loopback(r, mail), pool=BufferPool(torch.float32), credits=2)
    expect = execute_local(topo.p2p_plan, trainer)
    for e, got in enumerate(engines):
        bad = [k for k in expect[e] if not torch.equal(expect[e][k], got[k])]
        assert bad == [], (e, bad)
    assert all(not q for q in mail.values())


def test_registry_covers_every_mode_and_modes_are_typed() -> None:
    assert set(PATHS) == set(Mode)
    assert Mode("delta-p2p").plan is Mode.P2P and Mode.DELTA_DISK.plan is Mode.BROADCAST
    assert not Mode.DELTA_DISK.over_group and Mode.DELTA_BROADCAST.is_delta and not Mode.P2P.is_delta
    assert f"{Mode.P2P}" == "p2p" and Mode.P2P == "p2p" and Mode.delta("disk") is Mode.DELTA_DISK
    assert connection_modes(Mode.P2P, None) == FULL
    assert connection_modes(Mode.BROADCAST, "p2p") == (Mode.BROADCAST, Mode.DELTA_BROADCAST)
    assert connection_modes(Mode.P2P, "disk") == (*FULL, Mode.DELTA_DISK)


def test_fallback_names_the_failed_precondition() -> None:
    topo = Topology(PRESETS["tiny-qwen3"], MegatronParallel(tp=1), host=Host(pp=2))
    mode, why = choose_full(topo, "auto")
    assert mode is Mode.BROADCAST and "engine_pp_1" in why
    assert choose_full(_topo("tp2-tp1"), "auto") == (Mode.P2P, None)
    with pytest.raises(ValueError, match="mode must be one of"):
        choose_full(topo, "fastest")
