"""CUDA IPC on one GPU (marked ``gpu``: ``pytest -m gpu``): a trainer rank in this process and
an engine server process share the device; both IPC kinds land bitwise, and a trainer tensor
that moved between updates is re-exported and read from its new memory."""

from __future__ import annotations

import pytest

from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.spec import PRESETS
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.dist._engine import start_engine, stop_engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["map", "slots", "host"])
def test_ipc_updates_are_bitwise_on_one_gpu(kind: str) -> None:
    """``host``: the trainer's weights offloaded to pinned host memory, read by the GPU engine
    through the map path (page-locked on its side, strided QKV reads through a bounce buffer)."""
    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    par = MegatronParallel(tp=1, dtype="bfloat16")
    lay = Topology(spec, par).trainer_layout
    proc, url = start_engine("tiny-qwen3", 1, device="cuda", dtype="bfloat16")
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
        generation = program.mapped.generation if ipc == "map" else None
        sync.close()
        assert bad == [[], [], []]
        if ipc == "map":
            assert generation == 2  # re-exported once, for the moved tensor
    finally:
        stop_engine(proc)
