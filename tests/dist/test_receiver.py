"""The receiver as a library, with no reference engine around it: trainer ranks and engine
ranks in one spawned gloo world, the engine ranks hosting ``Receiver`` over each destination
kind.  Parameters written in place and slices handed to a loader both hold the trainer's
values bit for bit after p2p and broadcast updates."""

from __future__ import annotations

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.paths import Endpoint, UpdateArgs, compile_path
from shardsync.receiver import Loader, Params, Receiver, connect_request
from shardsync.runtime.schedule import subgroups
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.store.rendezvous import Rendezvous
from shardsync.store.rendezvous import open_store
from tests.dist._world import free_port, run_world

TRAINER_TP, ENGINE_TP = 2, 2


def _world(rank: int, world: int, port: int, destination: str, out) -> None:
    spec = PRESETS["tiny-qwen2"]
    topo = Topology(spec, MegatronParallel(tp=TRAINER_TP, dtype="float32"), (EngineParallel(tp=ENGINE_TP),))
    rdv = Rendezvous("127.0.0.1", port, world, "recv", timeout_s=30)
    results = {}
    if rank < TRAINER_TP:
        store = open_store(rdv, is_master=rank == 0)
        group = SyncGroup(rdv, rank, subgroups(topo), secret="a-test-secret-0123456789", store=store)
        params = load_rank(topo.trainer_layout, rank, random_source(spec, seed=1))
        ep = Endpoint(topo, rank, group, 16 * 1024, tensors=params, secret="a-test-secret-0123456789")
        programs = {m: compile_path(m, ep) for m in (Mode.P2P, Mode.BROADCAST)}
        for step, mode in enumerate((Mode.P2P, Mode.BROADCAST), start=1):
            for k, v in load_rank(topo.trainer_layout, rank, random_source(spec, seed=10 + step)).items():
                params[k].copy_(v)
            programs[mode].run(params, UpdateArgs(version=step))
        group.close()
        out.put((rank, results))
        return
    tp_rank = rank - TRAINER_TP
    layout = topo.engine_layouts[0]
    loaded: dict[str, torch.Tensor] = {}

    def load(slices) -> None:  # an engine loader: checkpoint-format boxes, one at a time
        for s in slices:
            full = loaded.setdefault(s.name, torch.full(s.full_shape, float("nan")))
            full[tuple(slice(o, o + n) for o, n in zip(s.offsets, s.tensor.shape, strict=True))] = s.tensor

    if destination == "params":
        dest = Params(load_rank(layout, tp_rank, random_source(spec, seed=99)))
    else:
        dest = Loader(layout.ranks[tp_rank], layout.logical, load, dtype=torch.float32)
    receiver = Receiver(spec, tp_rank, ENGINE_TP, dest, dtype=torch.float32, secret="a-test-secret-0123456789")
    fps = {m: topo.fingerprint(m) for m in ("p2p", "broadcast")}
    req = connect_request(topo, 0, fps, rdv, bucket_bytes=16 * 1024, credits=2, ipc=None, control="store")
    receiver.join(req)
    for step, mode in enumerate((Mode.P2P, Mode.BROADCAST), start=1):
        stats = receiver.receive(mode, UpdateArgs(version=step))
        src = random_source(spec, seed=10 + step)
        expect = load_rank(layout, tp_rank, src)
        got = dest.tensors()
        results[f"{mode}-engine-layout"] = [k for k in expect if not torch.equal(expect[k], got[k])]
        if destination == "loader":
            mine = {p.logical for p in layout.ranks[tp_rank].pieces}
            bad = []
            for name in mine:
                full = src(name).to(torch.float32)
                seen = ~torch.isnan(loaded[name])
                if not seen.any() or not torch.equal(loaded[name][seen], full[seen]):
                    bad.append(name)
            results[f"{mode}-loader"] = bad
            loaded.clear()
        results[f"{mode}-bytes"] = stats.bytes_received
    results["checksums"] = len(receiver.checksums())
    receiver.leave()
    out.put((rank, results))


@pytest.mark.parametrize("destination", ["params", "loader"])
def test_receiver_writes_every_destination_bitwise(destination: str) -> None:
    world = TRAINER_TP + ENGINE_TP
    results = run_world(_world, world, args=(world, free_port(), destination), timeout=120)
    for rank in range(TRAINER_TP, world):
        res = results[rank]
        for key, bad in res.items():
            if key.endswith(("layout", "loader")):
                assert bad == [], (rank, key, bad)
        assert res["p2p-bytes"] > 0 and res["broadcast-bytes"] > res["p2p-bytes"]
        assert res["checksums"] > 0
