"""CUDA IPC on one GPU (marked ``gpu``: ``pytest -m gpu``): a trainer rank in this process and
an engine server process share the device; both IPC kinds land bitwise, a trainer tensor
that moved between updates is re-exported and read from its new memory, and the map path's
CUDA events order both processes' work with no CPU synchronize."""

from __future__ import annotations

import itertools

import httpx
import pytest
import torch

from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.runtime.checksum import box_checksum
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["map", "slots", "host", "push"])
def test_ipc_updates_are_bitwise_on_one_gpu(kind: str) -> None:
    """``host``: the trainer's weights offloaded to pinned host memory, read by the GPU engine
    through the map path (page-locked on its side, strided QKV reads through a bounce buffer).
    ``push``: the trainer writes the staged engine's staging sets, alternating."""
    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    par = MegatronParallel(tp=1, dtype="bfloat16")
    lay = Topology(spec, par).trainer_layout
    proc, url = start_engine("tiny-qwen3", 1, device="cuda", dtype="bfloat16",
                             staging_bytes=-1 if kind == "push" else 0)
    device = "cpu" if kind == "host" else "cuda"
    try:
        params = load_rank(lay, 0, random_source(spec, seed=3), device=device)
        if kind == "host":
            params = {k: v.pin_memory() for k, v in params.items()}
        ipc = "map" if kind == "host" else kind
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc=ipc),
                                                                  transport=TransportConfig(bucket_mb=0.25)))
        sync.connect()
        bad = []
        for version in (1, 2, 3):
            fresh = load_rank(lay, 0, random_source(spec, seed=40 + version), device=device)
            for k, v in params.items():
                if version == 3 and k.endswith("linear_qkv.weight"):
                    v.set_(fresh[k].clone())  # new device memory the engine never mapped
                else:
                    v.copy_(fresh[k])
            rec = sync.update(version)
            assert rec.ok and rec.mode == "p2p"
            assert rec.source == ("device" if kind != "host" else "host"), rec.source
            bad.append(sync.verify())
        program = sync.programs[Mode.P2P]
        mapped = ipc in ("map", "push")
        generation = program.end.exports.generation if mapped else None
        signals = {link.how for link in program.end.links} if mapped else None
        sync.close()
        assert bad == [[], [], []]
        if mapped:
            assert generation == 2  # re-exported once, for the moved tensor
            assert signals == {"mailbox"}
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("kind", ["map", "slots", "push"])
def test_a_float32_bias_moves_as_its_own_bits_through_ipc(kind: str) -> None:
    """A bf16 GLM4-MoE: the router's expert bias is float32 on megatron-core and on the engine,
    so it moves as float32 bits through CUDA IPC (views of the bf16 buffers); ``verify`` hashes
    it in float32 on both ends, so a rounding would show."""
    spec = PRESETS["tiny-glm4-moe"].replace(dtype="bfloat16")
    par = MegatronParallel(tp=1, dtype="bfloat16")
    topo = Topology(spec, par)
    assert set(topo.raw_dtypes.values()) == {"float32"}
    proc, url = start_engine("tiny-glm4-moe", 1, device="cuda", dtype="bfloat16",
                             staging_bytes=-1 if kind == "push" else 0)
    try:
        params = load_rank(topo.trainer_layout, 0, random_source(spec, seed=3), device="cuda")
        bias = "decoder.layers.1.mlp.router.expert_bias"
        assert params[bias].dtype.itemsize == 4 and not params[bias].equal(params[bias].bfloat16().float())
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc=kind),
                                                                  transport=TransportConfig(bucket_mb=0.25)))
        sync.connect()
        bad = []
        for version in (1, 2):
            for k, v in load_rank(topo.trainer_layout, 0, random_source(spec, seed=50 + version),
                                  device="cuda").items():
                params[k].copy_(v)
            rec = sync.update(version)
            assert rec.ok and rec.mode == "p2p"
            bad.append(sync.verify())
            # the engine's own checksum of its float32 bias equals the trainer's float32 values' (a
            # bias rounded to bf16 on the way, or hashed in bf16, would differ)
            theirs = httpx.get(url + "/weights/checksum", timeout=30).json()["checksums"]
            name = "model.layers.1.mlp.gate.e_score_correction_bias"
            mine = box_checksum(params[bias].cpu(), (0,), (spec.num_experts,), torch.float32)
            assert int(theirs[name]) == mine, (version, theirs[name], mine)
        sync.close()
        assert bad == [[], []]
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("ipc,complete", [("map", "stream"), ("map", "host"), ("push", "stream"),
                                          ("slots", "stream")])
def test_map_reads_wait_for_queued_writes_and_later_writes_wait_for_the_reads(ipc: str, complete: str) -> None:
    """The trainer's writes are still queued behind ~0.1 s of GPU sleep when ``update()`` is
    called: the engine's copies must wait for them (the trainer's event).  Right after
    ``update()`` the trainer overwrites every tensor: those writes must wait for the engine's
    copies (the engine's event with ``stream``; the engine's synchronize with ``host``).  The
    engine then holds exactly the values written before the update.  ``host`` signals over the
    sync group instead of the mailbox.  ``push``: the engine commits (and ``verify`` reads what
    it serves) while the trainer's copies still wait behind the sleep: what it serves must wait
    for them on the GPU (the trainer's event).  ``slots``: small buckets cycle through the two
    slots; the engine's copies out wait for each slot's event, the trainer's copies in for the
    engine's (no CPU synchronizes per bucket)."""
    import torch

    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    par = MegatronParallel(tp=1, dtype="bfloat16")
    lay = Topology(spec, par).trainer_layout
    proc, url = start_engine("tiny-qwen3", 1, device="cuda", dtype="bfloat16",
                             staging_bytes=-1 if ipc == "push" else 0)
    try:
        params = load_rank(lay, 0, random_source(spec, seed=5), device="cuda")
        sync = WeightSync(spec, par, 0, params, [url], SyncConfig(
            mode="p2p", colocated=ColocatedConfig(ipc=ipc, complete=complete,
                                                  signals="group" if complete == "host" else "mailbox"),
            transport=TransportConfig(bucket_mb=0.05) if ipc == "slots" else TransportConfig()))
        sync.connect()
        bad = []
        for version in (1, 2, 3):
            fresh = load_rank(lay, 0, random_source(spec, seed=60 + version), device="cuda")
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)  # the writes below run ~0.1 s after update() is called
            for k, v in params.items():
                v.copy_(fresh[k])
            assert sync.update(version).ok
            for v in params.values():
                v.fill_(float(version))  # after the engine's reads, in stream order
            for k, v in params.items():
                v.copy_(fresh[k])
            bad.append(sync.verify())
        sync.close()
        assert bad == [[], [], []]
    finally:
        stop_engine(proc)


@pytest.mark.parametrize("ttp,etp", [(1, 1), (2, 1), (1, 2)])
def test_the_gather_kernel_copies_what_the_per_copy_path_copies(ttp: int, etp: int) -> None:
    """One Triton launch over the tile table = the per-copy path, bitwise (bf16 both sides),
    one tile per program replayed as a CUDA graph, and persistent programs with streaming
    accesses launched again."""
    import torch

    from shardsync.layout import EngineParallel
    from shardsync.plan.local import allocate
    from shardsync.plan.runs import coalesce, compile_runs
    from shardsync.transport.copies import Copies
    from shardsync.transport.gather import Gather, Tuning, available

    assert available(), "triton and CUDA are on the GPU machine"
    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    topo = Topology(spec, MegatronParallel(tp=ttp, dtype="bfloat16"), (EngineParallel(tp=etp, dtype="bfloat16"),))
    plan = topo.p2p_plan
    sources = [{n: t.cuda() for n, t in load_rank(topo.trainer_layout, r, random_source(spec, seed=9)).items()}
               for r in range(ttp)]
    tunings = (Tuning(tile_bytes=4096), Tuning(tile_bytes=4096, streaming=True, per_sm=1, graph=False))
    for e, tuning in itertools.product(range(etp), tunings):
        ref, got = allocate(plan, e, device="cuda"), allocate(plan, e, device="cuda")
        gathers = []
        for t in range(ttp):
            runs = coalesce([c for c in plan.copies if c.dst == e and c.src == t])
            if not runs:
                continue
            Copies.of(compile_runs(runs, sources[t], ref), gather=False).run()
            gathers.append(Gather(compile_runs(runs, sources[t], got), tuning))
        for g in gathers:
            g.run()  # launched (and captured as a graph where the tuning says so)
        for t in got.values():
            t.zero_()
        for g in gathers:
            g.run()  # replayed: what every later update runs
        torch.cuda.synchronize()
        assert all((g._graph is not None) == tuning.graph for g in gathers)
        for name in ref:
            assert torch.equal(ref[name].view(torch.int16), got[name].view(torch.int16)), (name, tuning)
