"""The gather kernel's tile table (``transport.gather.Segments``) covers exactly the bytes the
per-copy path copies: replayed here byte for byte on the CPU (the kernel itself runs in
tests/gpu)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.plan.local import allocate, execute_local
from shardsync.plan.runs import coalesce, compile_runs
from shardsync.presets import PRESETS
from shardsync.topology import Topology
from shardsync.transport.gather import Segments


@pytest.mark.parametrize("ttp,etp,tile", [(1, 1, 4096), (2, 1, 1000), (4, 2, 1 << 20)])
def test_tiles_replay_every_copy_of_the_plan(ttp: int, etp: int, tile: int) -> None:
    spec = PRESETS["tiny-qwen3"].replace(dtype="bfloat16")
    topo = Topology(spec, MegatronParallel(tp=ttp, dtype="bfloat16"), (EngineParallel(tp=etp, dtype="bfloat16"),))
    plan = topo.p2p_plan
    sources = [load_rank(topo.trainer_layout, r, random_source(spec, seed=3)) for r in range(ttp)]
    expected = execute_local(plan, sources)
    for e in range(etp):
        got = allocate(plan, e)  # zeros: a tile left out leaves zeros where the random weights belong
        for t in range(ttp):
            pairs = compile_runs(coalesce([c for c in plan.copies if c.dst == e and c.src == t]), sources[t], got)
            if not pairs:  # this trainer rank holds nothing of this engine rank
                continue
            seg = Segments.of(pairs)
            assert int(seg.nbytes.sum()) == sum(d.numel() * d.element_size() for d, _ in pairs)
            tiles = seg.tiles(tile)
            assert int(tiles.nbytes.max()) <= tile and int(tiles.nbytes.sum()) == int(seg.nbytes.sum())
            for s, d, n in zip(tiles.src.tolist(), tiles.dst.tolist(), tiles.nbytes.tolist(), strict=True):
                ctypes.memmove(d, s, n)
        for name, ref in expected[e].items():
            assert torch.equal(got[name].view(torch.int16), ref.view(torch.int16)), f"engine rank {e}: {name}"


def test_the_word_is_the_widest_common_alignment() -> None:
    a = torch.zeros(64, dtype=torch.bfloat16)
    b = torch.zeros(64, dtype=torch.bfloat16)
    assert Segments.of([(a[:8], b[:8])]).word() in (16, 8)  # allocations are aligned
    assert Segments.of([(a[1:9], b[1:9])]).word() == 2
    with pytest.raises(ValueError, match="one shape and dtype"):
        Segments.of([(a[:8], b[:4])])


def test_the_kernels_tuning_comes_from_the_environment_or_its_defaults(monkeypatch) -> None:
    from shardsync.transport.gather import Tuning, configured

    monkeypatch.delenv("SHARDSYNC_GATHER", raising=False)
    assert configured() == Tuning()
    monkeypatch.setenv("SHARDSYNC_GATHER", '{"per_sm": 2, "streaming": false}')
    assert configured() == Tuning(per_sm=2, streaming=False)
    monkeypatch.setenv("SHARDSYNC_GATHER", '{"tile": 2}')
    with pytest.raises(ValueError, match="SHARDSYNC_GATHER must be JSON of .*tile_bytes"):
        configured()
