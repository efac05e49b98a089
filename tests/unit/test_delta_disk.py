"""Delta versions on disk (one trainer rank, in process): exact apply, base checks, and a
crash between writing and publishing leaving the previous version intact and loadable."""

from __future__ import annotations

import json

import pytest
import torch

from shardsync.delta.disk import DiskPublisher, apply_version, read_manifest, version_dir
from shardsync.delta.encode import bits
from shardsync.delta.transfer import Snapshot
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import PRESETS
from shardsync.topology import Topology


def _setup(tmp_path):
    spec = PRESETS["tiny-llama"].replace(dtype="bfloat16")
    topo = Topology(spec, MegatronParallel(tp=1, dtype="float32"), (EngineParallel(tp=2),))
    params = load_rank(topo.trainer_layout, 0, random_source(spec, 1))
    snap = Snapshot(params, torch.bfloat16)
    snap.refresh()
    engine = [load_rank(topo.engine_layouts[0], r, random_source(spec, 1)) for r in range(2)]
    return topo, params, snap, engine, DiskPublisher(topo, 0, str(tmp_path), snap)


def _step(params: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params.values():
        m = torch.rand(p.shape, generator=g) < 0.02
        p[m] += 0.05 * torch.randn(int(m.sum()), generator=g)


def _expected(topo: Topology, params: dict[str, torch.Tensor], r: int) -> dict[str, torch.Tensor]:
    from shardsync.plan.local import execute_local

    return execute_local(topo.p2p_plan, [params])[r]


def test_disk_delta_applies_exactly_and_checks_its_base(tmp_path) -> None:
    topo, params, snap, engine, pub = _setup(tmp_path)
    _step(params, 1)
    stats = pub.write(1, 0, None)
    pub.publish(1, 0)
    assert stats.elements > 0 and stats.encodings["xor+zstd"] > 0
    for r in range(2):
        apply_version(tmp_path, 1, 0, engine[r], topo.engine_layouts[0].ranks[r])
        want = _expected(topo, params, r)
        for k in want:
            assert torch.equal(bits(want[k].to(torch.bfloat16)), bits(engine[r][k])), k
    with pytest.raises(ValueError, match="needs a full update"):
        apply_version(tmp_path, 1, 5, engine[0], topo.engine_layouts[0].ranks[0])
    # the files hold far less than the dense shard: 2 % of elements changed
    size = sum(f.stat().st_size for f in version_dir(tmp_path, 1).iterdir())
    dense = sum(p.numel() for p in params.values()) * 2
    assert size < 0.2 * dense, (size, dense)


def test_crash_before_publish_leaves_previous_version_intact(tmp_path) -> None:
    topo, params, snap, engine, pub = _setup(tmp_path)
    fresh = [dict((k, v.clone()) for k, v in e.items()) for e in engine]
    _step(params, 1)
    pub.write(1, 0, None)
    pub.publish(1, 0)
    v1 = {r: _expected(topo, params, r) for r in range(2)}
    snap.refresh()
    _step(params, 2)
    pub.write(2, 1, None)

    class Crash(RuntimeError):
        pass

    def crash() -> None:
        raise Crash("killed between writing and publishing")

    with pytest.raises(Crash):
        pub.publish(2, 1, before_rename=crash)
    assert not version_dir(tmp_path, 2).exists()
    with pytest.raises(FileNotFoundError, match="no published version 2"):
        read_manifest(tmp_path, 2)
    assert read_manifest(tmp_path, 1)["base_version"] == 0
    # an engine still at version 0 loads version 1 as if nothing had happened
    for r in range(2):
        apply_version(tmp_path, 1, 0, fresh[r], topo.engine_layouts[0].ranks[r])
        for k in v1[r]:
            assert torch.equal(bits(v1[r][k].to(torch.bfloat16)), bits(fresh[r][k])), k
    # the file checksum catches a corrupted part
    f = version_dir(tmp_path, 1) / "stage0.safetensors"
    data = bytearray(f.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin, end = json.loads(data[8:8 + header_len])["p0"]["data_offsets"]  # the embedding's part
    data[8 + header_len + (begin + end) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="xxh64"):
        apply_version(tmp_path, 1, 0, fresh[0], topo.engine_layouts[0].ranks[0])


def test_xor_into_a_wider_target_is_exact() -> None:
    """An engine holds a tensor wider than the wire (a float32 router bias under a bfloat16
    sync): the XOR applies in the wire dtype and widens back exactly."""
    from shardsync.delta.encode import _INT
    from shardsync.delta.parts import Part, apply_xor

    old = torch.randn(8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    new = old.clone()
    new[[1, 5]] += 1.0
    mask = old.view(_INT[2]) ^ new.view(_INT[2])
    target = old.float()  # the engine's float32 copy of the bf16 values it was sent
    part = Part(0, "bias", (0,), "bias", (0,), (8,))
    apply_xor(part, mask, {"bias": target}, [("bias", (slice(0, 8),), (slice(0, 8),))], torch.bfloat16)
    assert target.dtype == torch.float32 and torch.equal(target, new.float())


def test_disk_delta_moves_a_float32_bias_as_its_own_bits(tmp_path) -> None:
    """A sigmoid router's bias, float32 on the trainer and the engine of a bfloat16 sync, is
    published and applied in float32 (``raw``): a change below bfloat16's precision arrives."""
    spec = PRESETS["tiny-glm4-moe"].replace(dtype="bfloat16")
    topo = Topology(spec, MegatronParallel(tp=1, dtype="float32"), (EngineParallel(tp=2),))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in topo.raw_dtypes
    params = load_rank(topo.trainer_layout, 0, random_source(spec, 1))
    raw = {p.local: torch.float32 for p in topo.trainer_layout.ranks[0].pieces if p.logical in topo.raw_dtypes}
    snap = Snapshot(params, torch.bfloat16, raw=raw)
    snap.refresh()
    engine = [load_rank(topo.engine_layouts[0], r, random_source(spec, 1)) for r in range(2)]
    local = "decoder.layers.1.mlp.router.expert_bias"
    params[local][3] += 1e-5  # bfloat16 cannot tell this change apart
    assert torch.equal(params[local].to(torch.bfloat16), snap.values[local].to(torch.bfloat16))
    pub = DiskPublisher(topo, 0, str(tmp_path), snap)
    pub.write(1, 0, None)
    pub.publish(1, 0)
    for r in range(2):
        apply_version(tmp_path, 1, 0, engine[r], topo.engine_layouts[0].ranks[r])
        assert torch.equal(engine[r][bias], params[local]), r
