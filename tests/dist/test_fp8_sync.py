"""FP8 engines as a library (``quant/wire.py``, ``runtime/quantizer.py``, ``receiver/quantized.py``):
trainer ranks and engine ranks in one spawned gloo world, each engine rank holding e4m3 weights
and scales (SGLang's names) in place or staged.  The trainer quantizes the blocks it holds whole
and sends e4m3 words and scales; the others (the blocks a trainer shard cuts) arrive wide and
the engine quantizes them.  After every p2p and broadcast update the engine's
FP8 bytes and scales equal the quantizer applied to its shard of the trainer's weights (the shard
is whole blocks: the slice of the whole tensor's quantization, ``tests/unit/test_quant_fp8.py``),
the rest equals the trainer's bits, the checksums agree, and a corrupted scale shows in them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardsync.dtypes import torch_dtype
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout
from shardsync.mode import Mode
from shardsync.models.weights import load_rank, random_source
from shardsync.paths import Endpoint, UpdateArgs, compile_path
from shardsync.presets import PRESETS
from shardsync.quant import fp8_format, quantize, quantized
from shardsync.runtime.quantizer import SourceQuantizer
from shardsync.receiver import Params, Receiver, Staged, connect_request
from shardsync.receiver.quantized import Quantized
from shardsync.runtime.checksum import combine, compare, piece_checksums
from shardsync.runtime.schedule import subgroups
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.views import views_of
from tests.dist._world import free_port, run_world
from tests.fp8_straddle import STRADDLE

SECRET = "a-test-secret-0123456789"
FMT = fp8_format("fp8")


# STRADDLE (tests/fp8_straddle.py): q_proj's middle block rows, k, v and o_proj's middle block
# columns arrive wide, the rest of them and the MLP quantized
# experts of 384 rows at trainer expert TP 2: 192 rows each cut every expert's middle block
# (gate and up rows, down columns)
STRADDLE_MOE = PRESETS["tiny-qwen3-moe-fp8"].replace(name="tiny-qwen3-moe-fp8-straddle", moe_intermediate_size=384)
# 12 query and 4 KV heads of 64 from a TP 4 trainer (192 query rows each) into engine TP 2 (384:
# whole blocks): each engine rank's q_proj has one cut block in its middle, k and v arrive wide
STRADDLE_TP4 = STRADDLE.replace(name="tiny-qwen3-fp8-straddle-tp4", num_heads=12, num_kv_heads=4)
# per straddling model: the engine tensors that arrive part quantized, part wide, per layer;
# and how many logical tensors a doubled scale of the first FP8 tensor shows in
STRADDLES = {STRADDLE.name: (STRADDLE, ["o_proj.weight", "qkv_proj.weight"], 5),
             STRADDLE_MOE.name: (STRADDLE_MOE, ["experts.w13_weight", "experts.w2_weight"], 3),
             STRADDLE_TP4.name: (STRADDLE_TP4, ["o_proj.weight", "qkv_proj.weight"], 8)}


def _topology(model: str, trainer_tp: int, engine_tp: int, engine_ep: int) -> Topology:
    spec = STRADDLES[model][0] if model in STRADDLES else PRESETS[model]
    etp = None if model in STRADDLES or not (spec.is_moe and trainer_tp > 1) else 1  # None: expert TP = TP
    trainer = MegatronParallel(tp=trainer_tp, ep=engine_ep if spec.is_moe and trainer_tp > 1 else 1, etp=etp)
    return Topology(spec, trainer, (EngineParallel(tp=engine_tp, ep=engine_ep, dtype=spec.dtype),),
                    views=views_of(FMT.name))


def _world(rank: int, world: int, port: int, case: tuple, out) -> None:
    torch.set_num_threads(1)
    model, trainer_tp, engine_tp, engine_ep, staged = case
    topo = _topology(model, trainer_tp, engine_tp, engine_ep)
    spec = topo.spec
    rdv = Rendezvous("127.0.0.1", port, world, "fp8", timeout_s=60)
    modes = (Mode.P2P, Mode.BROADCAST)
    if rank < trainer_tp:
        store = open_store(rdv, is_master=rank == 0)
        group = SyncGroup(rdv, rank, subgroups(topo), secret=SECRET, store=store)
        params = load_rank(topo.trainer_base, rank, random_source(spec, seed=1))
        assert topo.fp8 is not None
        source = SourceQuantizer(topo.derived(rank), params, topo.fp8.fmt)  # as WeightSync does
        ep = Endpoint(topo, rank, group, 64 * 1024, tensors=source.tensors, secret=SECRET)
        programs = {m: compile_path(m, ep) for m in modes}
        sums = {}
        for step, mode in enumerate(modes, start=1):
            for k, v in load_rank(topo.trainer_base, rank, random_source(spec, seed=10 + step)).items():
                params[k].copy_(v)
            assert source.refresh()[1] > 0  # new weights: new FP8 bytes
            programs[mode].run(source.tensors, UpdateArgs(version=step))
            lay = topo.trainer_layout
            sums[mode.value] = piece_checksums(lay.ranks[rank], source.tensors, lay.logical, torch_dtype(spec.dtype),
                                               topo.check_dtypes)
        group.close()
        out.put((rank, {"sums": sums, "derived": len(topo.derived(rank))}))
        return
    tp_rank = rank - trainer_tp
    layout = engine_layout(spec, topo.engines[0])  # the engine's own tensors, as it serves them
    rl = layout.ranks[tp_rank]
    targets = quantized(rl, spec, FMT)
    dtype = torch_dtype(spec.dtype)
    live: dict[str, torch.Tensor] = {}  # what an FP8 engine holds: e4m3 weights, their scales, the rest
    for t in rl.tensors:
        target = targets.get(t.name)
        if target is None:
            live[t.name] = torch.zeros(t.stored, dtype=torch_dtype(t.dtype))  # float32 router bias
        else:
            live[t.name] = torch.zeros(t.stored, dtype=torch.float8_e4m3fn)
            live[target.scale] = torch.zeros(target.scale_shape)
    inner = Staged(live) if staged else Params(live)
    dest = Quantized(inner, targets, FMT, dtype=dtype)
    receiver = Receiver(spec, tp_rank, engine_tp, dest, dtype=dtype, secret=SECRET, ep=engine_ep,
                        views=views_of(FMT.name))
    fps = {m: topo.fingerprint(m) for m in ("p2p", "broadcast")}
    req = connect_request(topo, 0, fps, rdv, bucket_bytes=64 * 1024, credits=2, ipc=None, control="store")
    receiver.join(req)
    results: dict = {}
    for step, mode in enumerate(modes, start=1):
        stats = receiver.receive(mode, UpdateArgs(version=step))
        expect = load_rank(layout, tp_rank, random_source(spec, seed=10 + step))
        served = inner.served()
        bad = []
        for name, target in targets.items():
            q, s = quantize(expect[name].view(target.shape), FMT)
            if not (torch.equal(served[name].view(torch.uint8), q.view(torch.uint8))
                    and torch.equal(served[target.scale], s)):
                bad.append(name)
        bad += [n for n in expect if n not in targets and not torch.equal(served[n].view(expect[n].shape), expect[n])]
        results[mode.value] = {"bad": bad, "bytes": stats.bytes_received, "fp8": len(targets),
                               "derived": stats.derived_changed, "derive_s": stats.derive_s,
                               "sums": receiver.checksums()}
    results["direct"], results["wide"], results["mixed"] = sorted(dest.direct), sorted(dest.targets), sorted(dest.mixed)
    results["clean"] = [k for k, v in receiver.checksums().items() if v < 0]
    name, target = next(iter(targets.items()))
    inner.served()[target.scale].mul_(2)  # a stale scale
    results["stale"] = receiver.checksums()
    # the scales' checksums where they travel, the weights' where derived here (whole, or the
    # blocks that arrived wide into the twin)
    wire = topo.engine_layouts[0].ranks[tp_rank]
    shows = {target.scale} | {tw for tw, _, _ in dest.mixed.get(name, ())} if name in dest.direct else {name}
    results["stale_expected"] = sorted({p.logical for p in wire.pieces if p.local in shows})
    receiver.leave()
    out.put((rank, results))


CASES = [  # model, trainer TP, engine TP, engine EP, staged
    ("tiny-qwen3-fp8", 1, 4, 1, False),
    ("tiny-qwen3-fp8", 2, 1, 1, True),
    ("tiny-qwen3-moe-fp8", 2, 2, 2, True),
    ("tiny-qwen3-moe-fp8", 2, 4, 1, False),
    ("tiny-deepseek-v3-fp8", 2, 2, 2, True),  # MLA, sigmoid experts and a shared expert
    (STRADDLE.name, 2, 1, 1, False),
    (STRADDLE_MOE.name, 2, 1, 1, True),
    (STRADDLE_TP4.name, 4, 2, 1, False),
]


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c[0]}-t{c[1]}-e{c[2]}ep{c[3]}-{'staged' if c[4] else 'params'}")
def test_fp8_engine_holds_the_quantized_trainer_weights(case: tuple) -> None:
    trainer_tp, engine_tp = case[1], case[2]
    world = trainer_tp + engine_tp
    results = run_world(_world, world, args=(world, free_port(), case), timeout=240)
    topo = _topology(*case[:4])
    wide_topo = dataclasses.replace(topo, views=views_of(None))
    straddles = case[0] in STRADDLES
    engines = [results[r] for r in range(trainer_tp, world)]
    for mode in ("p2p", "broadcast"):
        expected = {k: v for k, v in combine(results[r]["sums"][mode] for r in range(trainer_tp)).items()
                    if k in topo.engine_held}  # not the MTP layer: engines hold none
        assert compare(expected, combine(res[mode]["sums"] for res in engines)) == [], mode
    for i, res in enumerate(engines):
        for mode in ("p2p", "broadcast"):
            assert res[mode]["bad"] == [] and res[mode]["fp8"] > 0, (i, mode, res[mode]["bad"][:4])
            # only the wide weights are quantized on the engine (all new: new FP8 bytes)
            assert (res[mode]["derived"] > 0 and res[mode]["derive_s"] > 0) == straddles
        assert res["broadcast"]["bytes"] > res["p2p"]["bytes"] or engine_tp == 1
        wide_bytes = wide_topo.p2p_plan.bytes_per_dst()[i]
        assert res["p2p"]["bytes"] < (0.7 if straddles else 0.6) * wide_bytes, (res["p2p"]["bytes"], wide_bytes)
        # every FP8 tensor is received quantized; where a trainer shard cuts blocks (q_proj's
        # middle block, k and v, o_proj's middle column block) just those blocks arrive wide
        assert res["wide"] == [] and len(res["direct"]) == res["p2p"]["fp8"]
        spec, kinds, shows = STRADDLES.get(case[0], (topo.spec, [], 2 if "deepseek" in case[0] else 3))
        assert sorted(n.split(".", 3)[-1].split(".", 1)[-1] for n in res["mixed"]) == sorted(kinds * spec.num_layers)
        assert res["clean"] == []
        # a doubled scale shows in checksums: the scales' where they travel, the weights' where derived
        stale = compare(expected, combine(r["stale"] for r in engines))
        assert stale == sorted({n for r in engines for n in r["stale_expected"]}), stale
        assert len(stale) == shows, stale
