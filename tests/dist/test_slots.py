"""The slots transport end to end on CPU: trainer ranks export bucket slots in shared memory, a
real engine server's TP workers map them; small buckets cycle through the two slots of each
link, so every slot is reused within an update and across updates.  Once both sides let go,
nothing of the slots is left in /dev/shm."""

from __future__ import annotations

import os

import torch.distributed as dist

from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.sync import WeightSync
from shardsync.transport.colocated.exports import identity
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world


def _trainer(rank: int, world: int, port: int, url: str, out) -> None:
    spec = PRESETS["tiny-qwen3"]
    par = MegatronParallel(tp=2, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=41)
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc="slots"),
                                 transport=TransportConfig(bucket_mb=0.02, timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    program = sync.programs[Mode.P2P]
    res = {"kind": type(program.slots).__name__, "records": [], "verify": []}
    sent = 0
    for version in (1, 2, 3):
        fresh = load_rank(lay, rank, random_source(spec, seed=300 + version))
        for k, v in params.items():
            v.copy_(fresh[k])
        rec = sync.update(version)
        sent += rec.bytes_sent
        res["records"].append({"ok": rec.ok, "mode": rec.mode, "bytes": rec.bytes_sent})
        res["verify"].append(sync.verify())
    res["through_slots"] = program.slots.copy_bytes == sent
    res["messages"] = sum(1 for s in program.steps if s.comm and s.comm[0] == "send")
    res["links"] = len(program.slots._out)
    res["files"] = [identity(t)[1].decode() for bufs in program.slots._out.values() for t in bufs]
    sync.close()  # the engine unmaps the slots; this process holds the last reference
    dist.destroy_process_group()
    out.put((rank, res))


def test_slots_over_shared_memory_are_bitwise_with_every_slot_reused() -> None:
    proc, url = start_engine("tiny-qwen3", 2)
    try:
        results = run_world(_trainer, 2, args=(2, free_port(), url), timeout=180)
        for rank, res in results.items():
            assert res["kind"] == "IpcTransport"
            assert all(r["ok"] and r["mode"] == "p2p" and r["bytes"] > 0 for r in res["records"]), res
            assert res["verify"] == [[], [], []], f"rank {rank}: checksum mismatch {res['verify']}"
            assert res["through_slots"], "every byte sent went through the slots"
            assert res["messages"] > 2, "small buckets: more messages than a link's two slots"
            assert res["links"] >= 1 and len(res["files"]) == 2 * res["links"], res["files"]  # two slots a link
        files = [f for r in results.values() for f in r["files"]]
        assert [f for f in files if os.path.exists("/dev/shm" + f)] == []
    finally:
        stop_engine(proc)
