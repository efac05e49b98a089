"""Real gloo worlds of trainer + engine processes: the resharding matrix through every path
and transport (p2p over the group, p2p read in place through shared memory, broadcast), bitwise."""

from __future__ import annotations

import pytest
import torch

from shardsync.dtypes import torch_dtype
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.mode import Mode
from shardsync.paths import Colocated, Endpoint, UpdateArgs, compile_path
from shardsync.vocab import Ipc
from shardsync.runtime.schedule import subgroups
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.store.rendezvous import Rendezvous
from shardsync.store.rendezvous import open_store
from tests.dist._world import free_port, run_world


def _worker(rank: int, world: int, port: int, case: dict, out) -> None:
    torch.set_num_threads(1)
    spec = PRESETS[case["model"]]
    if case.get("mqa"):
        spec = spec.replace(num_kv_heads=1)
    if case.get("wire"):
        spec = spec.replace(dtype=case["wire"])
    topo = Topology(spec, MegatronParallel(**case["trainer"], dtype="float32"),
                    tuple(EngineParallel(tp=t) for t in case["engines"]), relay=case.get("relay", False))
    rdv = Rendezvous("127.0.0.1", port, world, "t", timeout_s=30)
    store = open_store(rdv, is_master=True) if rank == 0 else None
    group = SyncGroup(rdv, rank, subgroups(topo), secret="a-test-secret-0123456789", store=store)
    T = topo.trainer.world_size
    results = {}
    programs = {}
    for step, mode in enumerate(case["modes"]):
        src = random_source(spec, seed=step + 1)
        if rank < T:
            if step == 0:
                local = load_rank(topo.trainer_layout, rank, src)  # fp32 master weights
            else:  # new values in place: mapped engines read these very tensors
                for k, v in load_rank(topo.trainer_layout, rank, src).items():
                    local[k].copy_(v)
        else:
            e = rank - T
            engine = max(i for i in range(len(topo.engines)) if topo.engine_rank_offset(i) <= e)
            if step == 0:
                # Engines start from other weights: any region a sync misses keeps them.
                local = load_rank(topo.engine_layouts[engine], e - topo.engine_rank_offset(engine),
                                  random_source(spec, seed=999))
        if mode not in programs:
            ipc = case.get("ipc") if mode == "p2p" else None
            ep = Endpoint(topo, rank, group, case.get("bucket", 64 * 1024), case.get("credits", 2),
                          colocated=Colocated(ipc=Ipc(ipc)) if ipc else None, tensors=local,
                          verify=case.get("verify", False), secret="a-test-secret-0123456789")
            programs[mode] = compile_path(Mode(mode), ep)
        stats = programs[mode].run(local, UpdateArgs(version=step))
        if rank >= T:
            e = rank - T
            wire = torch_dtype(topo.wire_dtype)

            direct = case.get("ipc") == "map" and mode == "p2p"  # the engine reads the trainer's tensors: no wire

            def sent(name: str, src=src) -> torch.Tensor:  # what the wire carries: raw tensors exactly
                return src(name) if direct or name in topo.raw_dtypes else src(name).to(wire).float()

            expect = load_rank(topo.engine_layouts[engine], e - topo.engine_rank_offset(engine), sent)
            bad = [k for k in expect if not torch.equal(expect[k].to(local[k].dtype), local[k])]
            results[mode + str(step)] = bad
            results["raw"] = sorted(topo.raw_dtypes)
        results[f"barriers{step}"] = group.barrier_calls
        results[f"sent{step}"] = stats.bytes_sent
        results[f"sent_mode{step}"] = mode
        results[f"pool_{mode}"] = getattr(programs[mode], "pool", None) and programs[mode].pool.allocated_bytes
    for program in programs.values():
        program.close()
    group.close()
    out.put((rank, results))


CASES = {
    # TP mismatch in both directions, KV replication (engine TP > kv heads), MQA
    "tp2-tp1": dict(model="tiny-qwen3", trainer=dict(tp=2), engines=[1], modes=["p2p", "broadcast"]),
    "tp2-tp4-kvrep": dict(model="tiny-qwen3", trainer=dict(tp=2), engines=[4], modes=["p2p", "broadcast"]),
    "tp4-tp2": dict(model="tiny-llama", trainer=dict(tp=4), engines=[2], modes=["p2p", "broadcast"]),
    "tp1-tp4": dict(model="tiny-qwen2", trainer=dict(tp=1), engines=[4], modes=["p2p", "broadcast"]),
    "mqa-tp1-tp4": dict(model="tiny-llama", mqa=True, trainer=dict(tp=1), engines=[4],
                        modes=["p2p", "broadcast"]),
    # pipeline parallel trainers
    "tp1pp2": dict(model="tiny-qwen3", trainer=dict(tp=1, pp=2), engines=[2], modes=["p2p", "broadcast"]),
    # many engines, different TP, DP replicas spreading the sending
    "relay-3engines": dict(model="tiny-qwen3", trainer=dict(tp=2), engines=[2, 2, 1], relay=True,
                           modes=["p2p", "broadcast"]),
    "dp2-2engines": dict(model="tiny-qwen3", trainer=dict(tp=1, dp=2), engines=[2, 1],
                         modes=["p2p", "broadcast"]),
    "tp2-tp2": dict(model="tiny-qwen3", trainer=dict(tp=2), engines=[2], modes=["p2p", "broadcast", "p2p"]),
    "tp2pp2-tp4-bf16": dict(model="tiny-qwen2", trainer=dict(tp=2, pp=2), engines=[4], wire="bfloat16",
                            modes=["broadcast", "p2p"]),
    # a sigmoid router's expert bias, float32 on both sides of a bfloat16 sync: moved as its own
    # bits (values below bfloat16's precision would round otherwise); experts over EP
    "glm4moe-tp2ep2-tp2-bf16": dict(model="tiny-glm4-moe", trainer=dict(tp=2, ep=2, etp=1), engines=[2],
                                    wire="bfloat16", modes=["p2p", "broadcast"]),
    "tp1pp3-uneven-2engines": dict(model="tiny-llama", trainer=dict(tp=1, pp=3, pp_layers=(2, 1, 1)),
                                   engines=[2, 1], modes=["p2p", "broadcast"], credits=1),
}


# p2p read in place (CPU shared memory stands in for CUDA IPC): every case relay aside
MAPPED = ["tp2-tp1", "tp2-tp4-kvrep", "tp4-tp2", "tp1pp2", "dp2-2engines", "tp2pp2-tp4-bf16",
          "tp1pp3-uneven-2engines", "glm4moe-tp2ep2-tp2-bf16"]


# every message followed by its digest (gathers, broadcasts, relays and p2p alike)
VERIFIED = ["tp2-tp4-kvrep", "relay-3engines", "tp2pp2-tp4-bf16", "glm4moe-tp2ep2-tp2-bf16"]


@pytest.mark.parametrize("name,ipc,verify", [(n, None, False) for n in CASES] + [(n, "map", False) for n in MAPPED]
                         + [(n, None, True) for n in VERIFIED])
def test_transfer_bitwise(name: str, ipc: str | None, verify: bool) -> None:
    case = dict(CASES[name], ipc=ipc, verify=verify)
    t = MegatronParallel(**case["trainer"]).world_size
    world = t + sum(case["engines"])
    results = run_world(_worker, world, args=(world, free_port(), case), timeout=120)
    for rank, res in results.items():
        for key, bad in res.items():
            if key.startswith(("p2p", "broadcast")):
                assert bad == [], f"{name} rank {rank} {key}: tensors differ: {bad[:5]}"
    if name == "glm4moe-tp2ep2-tp2-bf16":  # the bias of every sparse layer moved raw
        assert results[t]["raw"] == [f"model.layers.{n}.mlp.gate.e_score_correction_bias" for n in (1, 2, 3)]
    # p2p needs no gather: every rank's extra memory stays within credits x bucket
    budget = case.get("credits", 2) * case.get("bucket", 64 * 1024)
    for rank, res in results.items():
        if res.get("pool_p2p") is not None:
            assert res["pool_p2p"] <= budget, (rank, res["pool_p2p"], budget)
    if case.get("relay"):
        # the trainer sends one copy (to engine 0); engines 0 and 1 forward theirs
        topo = Topology(PRESETS[case["model"]], MegatronParallel(**case["trainer"]),
                        tuple(EngineParallel(tp=e) for e in case["engines"]), relay=True)
        shard_bytes = topo.p2p_plan.total_bytes
        step = case["modes"].index("p2p")
        assert sum(results[r][f"sent{step}"] for r in range(t)) == shard_bytes
        assert all(results[t + e][f"sent{step}"] > 0 for e in range(4))  # engine 0 and 1 ranks relay
    barrier_counts = {r: res[f"barriers{len(case['modes']) - 1}"] for r, res in results.items()}
    assert len(set(barrier_counts.values())) == 1, f"uneven barrier calls per rank: {barrier_counts}"
