"""A connect that names a rendezvous store holding a crafted pickle where tensor handles
belong: the engine executes nothing from it, refuses the join with a clear error and keeps
serving (nothing read from a store is unpickled)."""

from __future__ import annotations

import os
import threading

import httpx
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
