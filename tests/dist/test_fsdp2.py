"""FSDP2 trainers with real ``torch.distributed.fsdp.fully_shard`` on real ``transformers`` models
(CPU, gloo): the layout equals the DTensor shards' actual offsets and shapes (1-D meshes with
uneven rows, and HSDP); a sync from the module's local shards into a real engine server is
bitwise (p2p and broadcast), and after an AdamW step on the FSDP2 model the engine scores
like the model."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from shardsync.config import DeltaConfig, SyncConfig, TransportConfig
from shardsync.fsdp2 import fsdp2_parallel, local_shards
from shardsync.layout import Fsdp2Parallel, fsdp2_layout
from shardsync.models.weights import random_source
from shardsync.spec import ModelSpec
from shardsync.presets import PRESETS
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, run_world

SEED = 4


def _fsdp2_model(spec: ModelSpec, shape: tuple[int, ...]):
    """transformers' model for ``spec`` holding the random source's weights, fully_shard-ed per
    decoder layer and at the root on a CPU mesh of ``shape`` ((shard,) or (replicate, shard))."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    src = random_source(spec, SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src(name))
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _placements(rank: int, world: int, port: int, name: str, shape: tuple[int, ...], out) -> None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _init(rank, world, port)
    try:
        model = _fsdp2_model(PRESETS[name], shape)
        got = {}
        for n, p in model.named_parameters():
            local, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            got[n] = (tuple(p.to_local().shape), tuple(local), tuple(offset))
        par = fsdp2_parallel(model)
        out.put((rank, {"tensors": got, "par": (par.shard, par.replicate)}))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("name", "shape"), [("tiny-qwen3", (3,)), ("tiny-llama", (2,)), ("tiny-qwen2", (2, 2))],
                         ids=["qwen3-shard3", "llama-shard2", "qwen2-hsdp2x2"])
def test_layout_is_the_dtensor_shards(name: str, shape: tuple[int, ...]) -> None:
    spec = PRESETS[name]
    world = 1
    for s in shape:
        world *= s
    got = run_world(_placements, world, args=(world, free_port(), name, shape), timeout=120)
    par = Fsdp2Parallel(shard=shape[-1], replicate=shape[0] if len(shape) == 2 else 1)
    layout = fsdp2_layout(spec, par)
    uneven = 0
    for rank in range(world):
        assert got[rank]["par"] == (par.shard, par.replicate)
        rl = layout.ranks[rank]
        tensors = got[rank]["tensors"]
        assert set(tensors) == {t.name for t in rl.tensors}
        for t in rl.tensors:
            local, dt_local, offset = tensors[t.name]
            assert local == t.shape == dt_local, (rank, t.name, local, t.shape)
            pieces = rl.pieces_of(t.name)
            if t.shape[0]:
                assert [(p.offsets, p.sizes) for p in pieces] == [(offset, t.shape)], (rank, t.name)
            else:
                assert not pieces
            uneven += t.shape[0] != -(-layout.logical[t.name][0] // par.shard)
    if par.shard == 3:
        assert uneven > 0, "no tensor with an uneven last block: the case does not test the padding rule"


def _sync(rank: int, world: int, port: int, url: str, mode: str, out) -> None:
    from shardsync.launch.serving import serving
    from shardsync.sync import WeightSync

    _init(rank, world, port)
    sync = None
    try:
        spec = PRESETS["tiny-qwen3"]
        model = _fsdp2_model(spec, (world,))
        par = fsdp2_parallel(model, dtype="float32")
        shards = local_shards(model)
        delta = DeltaConfig(transport="p2p") if mode == "delta" else None
        sync = WeightSync(spec, par, rank, shards, [url],
                          SyncConfig(mode="auto" if delta else mode, delta=delta,
                                     transport=TransportConfig(bucket_mb=0.05, timeout_s=30)),
                          trainer_group=dist.group.WORLD)
        sync.connect()
        res = {"mode": sync.mode.value, "verify": [], "score_diff": None}
        rec = sync.update(1)
        res["verify"].append(sync.verify())
        # one AdamW step on the FSDP2 model (in place on the local shards), then sync it
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ids = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
        loss = -torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()
        loss.backward()
        opt.step()
        res["same_storage"] = all(local_shards(model)[n].data_ptr() == t.data_ptr() for n, t in shards.items())
        rec = sync.update(2)
        res["ok"], res["second"] = rec.ok, rec.mode
        res["verify"].append(sync.verify())
        with torch.no_grad():
            mine = torch.log_softmax(model(ids).logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
        if rank == 0:
            theirs = serving("reference").score(url, ids.tolist(), timeout_s=30)
            res["score_diff"] = float((mine - torch.as_tensor(theirs)[:, -mine.shape[1]:]).abs().max())
        out.put((rank, res))
    finally:
        if sync is not None:
            sync.close()
        dist.destroy_process_group()


# p2p and broadcast from a real FSDP2 module with AdamW steps also run in tests/dist/test_demo_models.py
# (shardsync demo --trainer fsdp2, checksums after every update); delta here starts with a full p2p.
@pytest.mark.parametrize("mode", ["broadcast", "delta"])
def test_sync_from_fsdp2_shards_is_bitwise(mode: str) -> None:
    # other weights than the trainer's; delta: a bf16 engine receives only the changed elements
    proc, url = start_engine("tiny-qwen3", 2, seed=99, **({"dtype": "bfloat16"} if mode == "delta" else {}))
    try:
        got = run_world(_sync, 2, args=(2, free_port(), url, mode), timeout=180)
        for rank, res in got.items():
            assert res["ok"] and res["mode"] == ("p2p" if mode == "delta" else mode)
            assert res["second"] == ("delta-p2p" if mode == "delta" else mode)
            assert res["verify"] == [[], []], (rank, res["verify"])
            assert res["same_storage"], "the optimizer step must update the shards the sync reads"
        # the engine scores like the FSDP2 model (bf16 engine: to bf16's precision)
        assert got[0]["score_diff"] is not None and got[0]["score_diff"] < (5e-2 if mode == "delta" else 1e-4)
    finally:
        stop_engine(proc)
