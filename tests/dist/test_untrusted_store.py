"""A connect that names a rendezvous store holding a crafted pickle where tensor handles
belong: the engine executes nothing from it, refuses the join with a clear error and keeps
serving (nothing read from a store is unpickled)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import torch

from shardsync.store.keys import Keys
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.receiver import connect_request, spec_from_dict
from shardsync.runtime.schedule import subgroups
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.store.rendezvous import Rendezvous
from shardsync.store.rendezvous import free_port, open_store
from shardsync.store.secret import load_secret
from tests.dist._engine import owner, start_engine, stop_engine


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # unpickling it creates the marker file


def test_crafted_pickle_in_the_rendezvous_store_is_never_executed(tmp_path) -> None:
    import pickle

    torch.set_num_threads(1)
    marker = str(tmp_path / "executed")
    proc, url = start_engine("tiny-qwen3", 1)
    try:
        info = httpx.get(url + "/weights/info", timeout=30).json()
        spec = spec_from_dict(info["spec"])
        topo = Topology(spec, MegatronParallel(tp=1), (EngineParallel(tp=1, dtype=info["dtype"]),))
        rdv = Rendezvous("127.0.0.1", free_port(), 2, "crafted", timeout_s=20)
        store = open_store(rdv, is_master=True)
        for key in (Keys(rdv.name).mapped(0, 1, 1), Keys(rdv.name).slots(0, 1)):
            store.set(key, pickle.dumps(_Payload(marker)))
        fps = {m: topo.fingerprint(m) for m in ("p2p", "broadcast")}
        req = connect_request(topo, 0, fps, rdv, bucket_bytes=1 << 20, credits=2, ipc="map", control="store")
        assert httpx.post(url + "/weights/connect", json=req.model_dump(mode="json"), headers=owner(), timeout=30).status_code == 200
        answer = {}
        joiner = threading.Thread(target=lambda: answer.update(
            r=httpx.post(url + "/weights/join", headers=owner(), timeout=60)))
        joiner.start()
        group = SyncGroup(rdv, 0, subgroups(topo), secret=load_secret().value, store=store)  # the engine gets as far as the handles
        joiner.join(90)
        group.close()
        r = answer["r"]
        assert r.status_code == 400, r.text
        assert "is not signed: refused" in r.json()["error"]  # the engine's secret: checked before parsing
        assert not os.path.exists(marker), "the engine unpickled a store value"
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 2}, timeout=30)
        assert gen.status_code == 200 and gen.json()["weight_version"] == 0
        version = httpx.get(url + "/weights/version", timeout=30).json()
        assert not version["stale"] and not version["connected"]
    finally:
        stop_engine(proc)


def _rogue(where: Rendezvous, attack: str, stop: threading.Event) -> None:
    """Another local client of the trainer's store that knows the sync's name (the worst
    case): a flood of junk keys, then unsigned junk under (or deletion of) the engine's answer
    keys of the first updates, over and over until stopped."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(where.host, where.port, None, False, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    keys = Keys(where.name)
    for i in range(2000):
        store.set(f"junk/{i}", "x" * 1024)
    while not stop.is_set():
        for seq in range(1, 4):
            for key in (keys.accepted(seq, 0), keys.result(seq, 0)):
                if attack == "junk":
                    store.set(key, '{"ok": true}')
                else:
                    store.delete_key(key)
        time.sleep(0.002)


def _trainer_under_attack(rank: int, world: int, port: int, url: str, attack: str, out) -> None:
    import torch.distributed as dist

    from shardsync.config import ControlConfig, SyncConfig, TransportConfig
    from shardsync.presets import load_spec
    from shardsync.sync import SyncError, WeightSync
    from tests.dist._world import join_trainer

    spec = load_spec("tiny-qwen3")
    par = MegatronParallel(tp=world, dtype="float32")
    _, params = join_trainer(rank, world, port, spec, par, seed=3)
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(mode="p2p", transport=TransportConfig(bucket_mb=0.05, timeout_s=5),
                                 control=ControlConfig(http_timeout_s=4)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    stop = threading.Event()
    if rank == 0:
        assert sync.group is not None
        rogue = threading.Thread(target=_rogue, args=(sync.group.rdv, attack, stop), daemon=True)
        rogue.start()
        time.sleep(1.0)  # the flood is in before the update starts
    t0 = time.monotonic()
    try:
        sync.update(1)
        res: dict = {"ok": True}
    except SyncError as e:
        res = {"error": str(e)}
    res["s"] = time.monotonic() - t0
    stop.set()
    out.put((rank, res))
    dist.destroy_process_group()


@pytest.mark.parametrize("attack,says", [("junk", "is not signed: refused"), ("deleted", "no answer under")])
def test_a_store_under_attack_fails_the_update_clearly_within_its_timeout(attack: str, says: str) -> None:
    """Junk under the engine's answer keys is refused as unsigned, always; an answer deleted as
    it comes is a race the trainer may win (it read the answer first: the update is whole and
    fine) or lose (the wait ends at its bound, 4 s, the store's own 5 s at most, naming the key).
    Either way a clear outcome, never a hang, and the engine holds one whole version (its old
    one, or the new one it took in full)."""
    from tests.dist._world import free_port as world_port
    from tests.dist._world import run_world

    proc, url = start_engine("tiny-qwen3", 2)
    try:
        res = run_world(_trainer_under_attack, 2, args=(2, world_port(), url, attack), timeout=120)
        for r in (0, 1):
            if attack == "junk" or "error" in res[r]:
                assert "error" in res[r] and says in res[r]["error"], res
            assert res[r]["s"] < 4 + 5 + 3, res  # the wait's bound, a get's, and slack: no hang
        health = httpx.get(url + "/health", timeout=30).json()
        # stale (refusing generation) when its receive had begun: never a mix of versions
        assert health["status"] in ("ok", "stale") and health["weight_version"] in (0, 1), health
    finally:
        stop_engine(proc)
