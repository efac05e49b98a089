"""FP8 on a GPU (marked ``gpu``: ``pytest -m gpu``): the fused block quantizer (``runtime.fp8_kernel``)
equals ``fp8.quantize`` bit for bit on random bf16 matrices (partial blocks, strided views,
float32 and ue8m0 scales) and counts exactly the e4m3 bytes and scales that change; a trainer on
the GPU syncs an FP8 reference engine on the same GPU through CUDA IPC (map and push), bitwise."""

from __future__ import annotations

import pytest
import torch

from shardsync.config import ColocatedConfig, SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.quant.fp8 import fp8_format, quantize
from shardsync.runtime.fp8_kernel import quantize_into
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from shardsync.views import views_of
from tests.dist._engine import start_engine, stop_engine
from tests.fp8_straddle import STRADDLE

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fmt", ["fp8", "fp8-block128x128-ue8m0"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 260), (128, 128), (1000, 2560)])
def test_fused_quantizer_is_bitwise_and_counts_changes(fmt: str, shape: tuple[int, int]) -> None:
    f = fp8_format(fmt)
    g = torch.Generator(device="cuda").manual_seed(sum(shape))
    w = (torch.randn(*shape, device="cuda", generator=g) * torch.rand(shape[0], 1, device="cuda", generator=g)
         * 0.1).to(torch.bfloat16)
    w[:128, :128] = 0  # an all-zero block: the floored amax
    ref_q, ref_s = quantize(w, f)
    q = torch.full((shape[0], shape[1] // 4), -1, dtype=torch.int32, device="cuda")  # poisoned
    s = torch.full(f.scale_shape(shape), -1.0, device="cuda")
    n = torch.zeros(1, dtype=torch.int64, device="cuda")
    quantize_into(w, q, s, f, n)
    assert torch.equal(q.view(torch.uint8).view(shape), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    assert int(n) == w.numel() + s.numel() - int((ref_q.view(torch.uint8) == 0xFF).sum())  # every byte new
    n.zero_()
    quantize_into(w, q, s, f, n)
    assert int(n) == 0  # the same weights: nothing changes
    w2 = w.clone()
    w2[5, 7] += 1.0  # one block's amax moves: its bytes and its scale
    ref2_q, ref2_s = quantize(w2, f)
    quantize_into(w2, q, s, f, n)
    expect = int((ref2_q.view(torch.uint8) != ref_q.view(torch.uint8)).sum() + (ref2_s != ref_s).sum())
    assert int(n) == expect > 0
    # a strided view (a region of a wider parameter) reads in place
    wide = torch.randn(shape[0], shape[1] + 64, device="cuda", generator=g).to(torch.bfloat16)
    view = wide[:, 32:32 + shape[1]]
    quantize_into(view, q, s, f, n)
    ref3_q, ref3_s = quantize(view, f)
    assert torch.equal(q.view(torch.uint8).view(shape), ref3_q.view(torch.uint8)) and torch.equal(s, ref3_s)


@pytest.mark.parametrize("ipc", ["map", "push"])
def test_a_gpu_trainer_syncs_an_fp8_engine_through_ipc(ipc: str) -> None:
    """map: the engine reads the e4m3 words the trainer quantized; push: the trainer writes them
    into the engine's staging copy (whole shards staged)."""
    spec = PRESETS["tiny-qwen3-fp8"]
    par = MegatronParallel(tp=1, dtype="bfloat16")
    topo = Topology(spec, par, views=views_of("fp8"))
    proc, url = start_engine(spec.name, 1, device="cuda", dtype="bfloat16", quantization="fp8",
                             staging_bytes=-1 if ipc == "push" else 0)
    try:
        params = load_rank(topo.trainer_base, 0, random_source(spec, seed=3), device="cuda")
        sync = WeightSync(spec, par, 0, params, [url],
                          SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc=ipc), detail=True,
                                     transport=TransportConfig(timeout_s=120)))
        sync.connect()
        try:
            for v in (1, 2, 3):  # the push's first update runs its kernels, the next replay their graph
                params["decoder.layers.0.mlp.linear_fc1.weight"].mul_(1.5)
                rec = sync.update(v)
                assert rec.ok and rec.phases["quantize"] > 0
                assert sync.verify() == []  # the trainer quantizes everything again for its checksums
            assert sync._fp8 is not None
            # push: the regions held in one piece are quantized straight into the engine's staging
            assert bool(sync._fp8.pushed) == (ipc == "push")
        finally:
            sync.close()
    finally:
        stop_engine(proc)


def test_block_rows_read_in_place_equal_the_assembled_matrix() -> None:
    """``rows``: block row ``i`` starts at source row ``rows[i]`` (pieces of Megatron's fused
    QKV read in place): the same bytes and scales as the rows gathered first."""
    f = fp8_format("fp8")
    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(1024, 384, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    starts = [512, 0, 768, 128]
    ref_q, ref_s = quantize(torch.cat([w[r:r + 128] for r in starts]), f)
    q = torch.full((512, 96), -1, dtype=torch.int32, device="cuda")
    s = torch.full(f.scale_shape((512, 384)), -1.0, device="cuda")
    quantize_into(w, q, s, f, rows=torch.tensor(starts, dtype=torch.int32, device="cuda"))
    assert torch.equal(q.view(torch.uint8).view(512, 384), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


def test_a_trainer_quantizes_megatrons_fused_qkv_in_place() -> None:
    """Heads of 128 rows: each query group's q, k and v of Megatron's ``linear_qkv`` are whole
    blocks, so the trainer reads them in place; every region's words and scales equal the
    quantizer of the region assembled (``SourceQuantizer.region``)."""
    from shardsync.runtime.quantizer import SourceQuantizer

    spec = PRESETS["tiny-qwen3-fp8"].replace(name="tiny-qwen3-fp8-128", head_dim=128, num_heads=4, num_kv_heads=2)
    topo = Topology(spec, MegatronParallel(tp=1, dtype="bfloat16"), views=views_of("fp8"))
    params = load_rank(topo.trainer_base, 0, random_source(spec, seed=9), device="cuda")
    assert topo.fp8 is not None
    source = SourceQuantizer(topo.derived(0), params, topo.fp8.fmt)
    assert any(len(d.parts) > 1 for d in source.derived) and source._rows  # the QKV regions, read in place
    for _ in range(2):  # the first refresh runs the kernels, the second replays their graph
        params["decoder.layers.0.self_attention.linear_qkv.weight"].mul_(1.25)
        source.refresh()
        for d in source.derived:
            ref_q, ref_s = quantize(source.region(d), topo.fp8.fmt)
            got = source.tensors[d.words].view(torch.uint8).view(ref_q.shape)
            assert torch.equal(got, ref_q.view(torch.uint8)) and torch.equal(source.tensors[d.scales], ref_s), d.logical


@pytest.mark.parametrize("rank", [0, 1])
def test_a_trainer_rank_quantizes_the_whole_cells_of_a_straddling_weight(rank: int) -> None:
    """6 query heads of 64 at trainer TP 2: each rank's 192 query rows cut q_proj's middle block;
    each rank quantizes its whole cells (``quant.wire.cells``) on the GPU, bitwise equal to the
    quantizer of the cell's rows of the full weight."""
    from shardsync.runtime.quantizer import SourceQuantizer

    spec = STRADDLE
    topo = Topology(spec, MegatronParallel(tp=2, dtype="bfloat16"), views=views_of("fp8"))
    assert topo.fp8 is not None and topo.fp8.split
    params = load_rank(topo.trainer_base, rank, random_source(spec, seed=9), device="cuda")
    full = random_source(spec, seed=9)
    source = SourceQuantizer(topo.derived(rank), params, topo.fp8.fmt)
    whole_cells = {c.name for cs in topo.fp8.split.values() for c in cs if c.quantized}
    cells = [d for d in source.derived if d.logical in whole_cells]
    assert len(cells) == 2 * spec.num_layers  # one q_proj and one o_proj cell per layer and rank
    for _ in range(2):  # the first refresh runs the kernels, the second replays their graph
        source.refresh()
        for d in cells:
            weight = next(n for n, cs in topo.fp8.split.items() if any(c.name == d.logical for c in cs))
            (r0, c0), (nr, nc) = d.offsets, d.sizes
            ref_q, ref_s = quantize(full(weight).to(torch.bfloat16)[r0:r0 + nr, c0:c0 + nc].cuda(), topo.fp8.fmt)
            got = source.tensors[d.words].view(torch.uint8).view(ref_q.shape)
            assert torch.equal(got, ref_q.view(torch.uint8)) and torch.equal(source.tensors[d.scales], ref_s), d.logical


def _push_rank(rank: int, world: int, port: int, url: str, model: str, out) -> None:
    """One of ``world`` trainer ranks on the same GPU, pushing into the FP8 engine there."""
    import torch.distributed as dist

    from shardsync.presets import load_spec
    from tests.dist._world import join_trainer

    spec = load_spec(model)
    par = MegatronParallel(tp=world, dtype="bfloat16")
    _, params = join_trainer(rank, world, port, spec, par, seed=5)
    params = {n: t.cuda() for n, t in params.items()}
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc="push"), detail=True,
                                 transport=TransportConfig(timeout_s=120)), trainer_group=dist.group.WORLD)
    sync.connect()
    res: dict = {"ok": [], "verify": [], "pushed": 0}
    name = next(n for n in params if n.endswith("linear_fc1.weight"))
    for version in (1, 2, 3):  # the first update runs the kernels, the next replay their graphs
        params[name].mul_(1.5)
        res["ok"].append(sync.update(version).ok)
        res["verify"].append(sync.verify())
    assert sync._fp8 is not None
    res["pushed"] = len(sync._fp8.pushed)
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


@pytest.mark.parametrize("straddle", [False, True])
def test_two_trainer_ranks_on_one_gpu_push_into_an_fp8_engine(straddle: bool, tmp_path) -> None:
    """Trainer TP 2, both ranks on the engine's GPU, push: each rank quantizes its regions straight
    into the engine's staging copy (the straddling model's cut blocks go as bf16 into the twin,
    the engine quantizes them); bitwise after every update."""
    from tests.dist._world import free_port, run_world
    from tests.fp8_straddle import straddle_config

    model = straddle_config(tmp_path) if straddle else "tiny-qwen3-fp8"
    proc, url = start_engine(model, 1, device="cuda", dtype="bfloat16", quantization="fp8", staging_bytes=-1)
    try:
        results = run_world(_push_rank, 2, args=(2, free_port(), url, model), timeout=300)
        for rank, res in results.items():
            assert res["ok"] == [True] * 3 and res["verify"] == [[], [], []], (rank, res)
            assert res["pushed"] > 0  # regions written straight into the engine by the kernel
    finally:
        stop_engine(proc)
