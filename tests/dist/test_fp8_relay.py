"""Relay into FP8 reference engines: the trainer sends one copy (its e4m3 bytes and scales, and
the blocks its shards cut wide) to the first engine, which forwards what it received (the
words it serves, the cut blocks from its model-dtype twin) to the second; both quantize the cut
blocks themselves and verify bitwise after every update."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from shardsync.config import SyncConfig, TransportConfig
from shardsync.layout import MegatronParallel
from shardsync.presets import load_spec
from shardsync.sync import WeightSync
from tests.dist._engine import start_engine, stop_engine
from tests.dist._world import free_port, join_trainer, run_world
from tests.fp8_straddle import straddle_config


def _trainer(rank: int, world: int, port: int, urls: list[str], model: str, out) -> None:
    spec = load_spec(model)
    par = MegatronParallel(tp=world, dtype="bfloat16")
    _, params = join_trainer(rank, world, port, spec, par, seed=5)
    sync = WeightSync(spec, par, rank, params, urls, SyncConfig(mode="p2p", relay=True, detail=True,
                      transport=TransportConfig(timeout_s=60)), trainer_group=dist.group.WORLD)
    sync.connect()
    res: list = []
    name = next(n for n in params if n.endswith("linear_qkv.weight"))
    for v in (1, 2):
        params[name].mul_(1.5)
        rec = sync.update(v)
        res.append((rec.ok, rec.error, sync.verify(), [e.derived_changed for e in rec.engines]))
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_relay_forwards_fp8_words_and_the_cut_blocks(tmp_path: Path) -> None:
    model = straddle_config(tmp_path)
    started = [start_engine(model, 1, dtype="bfloat16", quantization="fp8") for _ in range(2)]
    try:
        results = run_world(_trainer, 2, args=(2, free_port(), [u for _, u in started], model), timeout=240)
        for res in results.values():
            assert all(ok and mismatched == [] for ok, _, mismatched, _ in res), res
            # each engine quantized the blocks that arrived wide, the second from what the first forwarded
            assert all(len(derived) == 2 and min(derived) > 0 for _, _, _, derived in res), res
    finally:
        for p, _ in started:
            stop_engine(p)
