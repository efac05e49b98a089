"""The one-sided (mapped) transport end to end on CPU: trainer ranks export their tensors
through shared memory, a real engine server's TP workers map them and read in place."""

from __future__ import annotations

import datetime
import os

import httpx
import pytest
import torch
import torch.distributed as dist

from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.mode import Mode
from shardsync.paths.p2p import ColocatedProgram
from shardsync.sync import SyncError, WeightSync
from shardsync.topology import Topology
from shardsync.transport.colocated.map_sender import MapSender
from shardsync.transport.colocated.push_sender import PushSender
from shardsync.transport.mailbox import STAGED
from tests.dist._engine import owner, shard_bytes, start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world


def _end(sync: WeightSync) -> MapSender | PushSender:
    program = sync.programs[Mode.P2P]
    assert isinstance(program, ColocatedProgram), type(program)
    end = program.end  # a trainer rank's end of the colocated wing
    assert isinstance(end, (MapSender, PushSender)), type(end)
    return end


def _staged_sets(sync: WeightSync) -> list[int]:
    """push: the staging set each engine rank of this trainer rank's links posted last (map: none)."""
    end = _end(sync)
    if not isinstance(end, PushSender):
        return []
    boxes = [link.box for link in end.links if link.box is not None]
    return [box._read(STAGED, 1)[1][0] for box in boxes if box._read(STAGED, 1)]


def _signals(sync: WeightSync) -> list[str]:
    """How this trainer rank's links signal, as the engines chose (read at the first update)."""
    return sorted({link.how for link in _end(sync).links if link.how is not None})


def _trainer(rank: int, world: int, port: int, url: str, signals: str, ipc: str, out) -> None:
    spec = PRESETS["tiny-qwen3"]
    par = MegatronParallel(tp=2, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=31)
    sync = WeightSync(spec, par, rank, params, [url], SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc=ipc, signals=signals), detail=True,
                                                             transport=TransportConfig(timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"records": [], "verify": [], "generation": [], "sets": []}
    res["kind"] = type(_end(sync)).__name__
    res["signals"] = _signals(sync)  # none yet: read at the first update
    # push checks and copies the largest tensor first, the rest while it copies: move either
    largest = max(sorted(params), key=lambda k: params[k].numel() * params[k].element_size())
    end = _end(sync)
    if isinstance(end, PushSender):
        res["lead"] = end.parts[0] == [largest]
    for version in (1, 2, 3, 4):
        fresh = load_rank(lay, rank, random_source(spec, seed=200 + version))
        for k, v in params.items():
            if (version == 3 and k.endswith("linear_qkv.weight")) or (version == 4 and k == largest):
                v.set_(fresh[k].clone())  # offloaded and reloaded: new memory the engine never mapped
            else:
                v.copy_(fresh[k])  # in place: the engine reads the parameters where they live
        rec = sync.update(version)
        res["records"].append({"ok": rec.ok, "mode": rec.mode, "bytes": rec.bytes_sent,
                               "step_bytes": sum(st["bytes"] for st in rec.steps),
                               "plan_bytes": sync.topo.p2p_plan.bytes_per_src().get(rank, 0)})
        res["verify"].append(sync.verify())
        res["generation"].append(_end(sync).exports.generation)
        res["sets"].append(_staged_sets(sync))
    res["signals"] += _signals(sync)
    # an older version: the engine refuses the pipelined begin and answers the trainer's signal
    # in place of the copies, so the refusal is prompt and the connection stays usable
    try:
        sync.update(2)
        res["refused"] = "accepted"
    except SyncError as e:
        res["refused"] = str(e)
    res["kept_group"] = sync.group is not None
    res["sets_after_refusal"] = _staged_sets(sync)
    # a tensor whose shape changed since connect (a user bug) fails the update on every rank,
    # promptly (rank 1 aborts, engines ack), and the engine refuses to serve the mix it holds
    name = next(k for k in params if k.endswith("linear_fc2.weight"))
    good = params[name].clone()
    if rank == 1:
        params[name].set_(good[:, :-1].contiguous())
    try:
        sync.update(5)
        res["bad_update"] = "accepted"
    except SyncError as e:
        res["bad_update"] = str(e)
    if rank == 0:
        res["stale_status"] = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1},
                                         timeout=30).status_code
    params[name].set_(good)
    sync.connect()
    print(f"DBG rank {rank} connected", flush=True)  # a failed update drops the group; reconnect and send a full update
    sync.update(6)
    res["after"] = sync.verify()
    res["files"] = sorted(_end(sync).exports.shm_names)
    sync.close()  # engines unmap: the trainer holds the last reference to its shared memory
    dist.destroy_process_group()
    out.put((rank, res))


CASES = {  # id: (ipc, signals, the engine's staging bytes: 0 in place, -1 its whole shard)
    "in-place-mailbox": ("map", "mailbox", 0),
    "window-group": ("map", "group", shard_bytes("tiny-qwen3", 2) // 3),
    "push-staged": ("push", "mailbox", -1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_reads_trainer_tensors_in_place_and_remaps_moved_ones(case: str) -> None:
    """In place, the signals go through shared-memory mailboxes; ``window`` (signals over the
    sync group): a third of the shard staged; the engine copies into staging first, then
    pauses and copies the rest into its served weights.  ``push``: the trainer writes the
    engine's whole staging copy itself (alternating sets), the engine swaps it in."""
    ipc, signals, staging = CASES[case]
    window = staging != 0
    proc, url = start_engine("tiny-qwen3", 2, staging_bytes=staging)
    try:
        results = run_world(_trainer, 2, args=(2, free_port(), url, signals, ipc), timeout=180)
        for rank, res in results.items():
            assert res["kind"] == ("PushSender" if ipc == "push" else "MapSender")
            if ipc == "push":  # every commit swapped the sets: the next update writes the other one
                assert res["sets"] == [[1, 1], [0, 0], [1, 1], [0, 0]] and res["sets_after_refusal"] == [0, 0], res
                assert res["lead"], "the test moves the tensor push copies first"
            assert res["signals"] == [signals], res["signals"]  # as offered, as the engine chose
            assert all(r["ok"] and r["mode"] == "p2p" for r in res["records"])
            assert res["verify"] == [[], [], [], []], f"rank {rank}: checksum mismatch {res['verify']}"
            assert all(r["bytes"] == r["plan_bytes"] == r["step_bytes"] > 0 for r in res["records"])
            # versions 3 and 4 moved a tensor: exported again and read from its new memory
            assert res["generation"] == [1, 1, 2, 3]
        for rank, res in results.items():
            assert "refused" in res["refused"] and "older than the engine's 4" in res["refused"], res["refused"]
            assert res["kept_group"]
            # rank 1 refused its own tensors; rank 0 learns it from the engine, which heard the
            # abort (a receive that timed out would say so instead)
            expected = "changed shape since connect" if rank == 1 else "trainer sync rank 1 aborted the update"
            assert expected in res["bad_update"], res["bad_update"]
            assert res["after"] == []
        # in place the aborted update left a mix: refused; a window's abort came before the pause
        assert results[0]["stale_status"] == (200 if window else 503)
        # once the trainer ranks let go, torch removes the names: nothing is left in /dev/shm
        files = [f for r in results.values() for f in r["files"]]
        assert files and [f for f in files if os.path.exists("/dev/shm" + f)] == []
        begin = httpx.post(url + "/weights/begin", json={"version": 7, "mode": "p2p", "fingerprint": "x"},
                           headers=owner(), timeout=30)
        assert begin.status_code == 409 and "not connected" in begin.text  # the engine left the group
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2, 3]], "max_new_tokens": 3}, timeout=30)
        assert gen.json()["weight_version"] == 6
    finally:
        stop_engine(proc)


def _push_connect(rank: int, world: int, port: int, url: str, out) -> None:
    spec = PRESETS["tiny-qwen3"]
    par = MegatronParallel(tp=1, dtype="float32")
    _, params = join_trainer(rank, world, port, spec, par, seed=7)
    sync = WeightSync(spec, par, rank, params, [url], SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc="push"),
                                                             transport=TransportConfig(timeout_s=30)),
                      trainer_group=dist.group.WORLD)
    try:
        sync.connect()
        out.put((rank, "connected"))
    except SyncError as e:
        out.put((rank, str(e)))
    dist.destroy_process_group()


def test_push_into_an_engine_without_whole_staging_is_refused_at_connect() -> None:
    """An in-place engine has no staging copy for the trainer to write: the connect fails
    naming the engine setting, and the engine keeps serving its weights."""
    proc, url = start_engine("tiny-qwen3", 1, staging_bytes=0)
    try:
        result = run_world(_push_connect, 1, args=(1, free_port(), url), timeout=120)[0]
        assert "staging_bytes=-1" in result and "ipc='map'" in result, result
        gen = httpx.post(url + "/generate", json={"prompts": [[1, 2]], "max_new_tokens": 1}, timeout=30)
        assert gen.status_code == 200
    finally:
        stop_engine(proc)
