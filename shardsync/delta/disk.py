"""Delta versions on disk: each pipeline stage writes its own safetensors file, rank 0
publishes the version atomically, engines pull and apply.

Layout of ``root``::

    v000007/manifest.json        {version, base_version, encoding, compression, checksum, stages}
    v000007/stage0.safetensors   uint8 tensor per part (XOR vs the previous bytes, zstd),
                                 metadata: part boxes, wire dtype, xxh64 of every blob
    .v000008.tmp/                a version being written: never read

Publishing is write, fsync, rename: a reader sees a whole version or none.  XOR applies
exactly once on the right base, so every pull checks ``base_version`` first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from shardsync.delta.encode import xor_decode, xor_encode
from shardsync.delta.parts import Part, apply_xor, stage_parts, targets_for
from shardsync.delta.transfer import Snapshot, gather_stage
from shardsync.dtypes import torch_dtype
from shardsync.piece import RankLayout
from shardsync.runtime.executor import BufferPool
from shardsync.runtime.stats import Stats
from shardsync.topology import Topology
from shardsync.transport import SyncGroup

MANIFEST = "manifest.json"


def version_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def _tmp_dir(root: str | Path, version: int) -> Path:
    return Path(root) / f".v{version:06d}.tmp"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pack_blobs(blobs: list[bytes]) -> torch.Tensor:
    sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64).view(torch.uint8)
    body = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs if b]
    return torch.cat([sizes, *body])


def _unpack_blobs(data: torch.Tensor, n: int) -> list[bytes]:
    sizes = data[:8 * n].clone().view(torch.int64).tolist()
    out, pos = [], 8 * n
    for s in sizes:
        out.append(data[pos:pos + s].numpy().tobytes())
        pos += s
    return out


@dataclass
class DiskPublisher:
    """Trainer side.  Collective over the trainer ranks of the sync group (engines do not
    take part): every DP-0 rank encodes its parts, each stage source writes the stage's
    file, trainer rank 0 writes the manifest and renames the version into place."""

    topo: Topology
    me: int
    root: str
    snapshot: Snapshot
    budget: int = 64 * 2**20
    credits: int = 2
    verify: bool = False

    def __post_init__(self) -> None:
        self.pool = BufferPool(torch.uint8)
        self._parts: dict[int, list[Part]] = {}  # per stage, derived once

    def write(self, version: int, base_version: int, group: SyncGroup | None) -> Stats:
        """Write this rank's share of ``version`` into the temporary directory."""
        stats = Stats()
        tmp = _tmp_dir(self.root, version)
        for stage in range(self.topo.trainer.pp):
            members = self.topo.stage_ranks(stage)
            if self.me not in members:
                continue
            if stage not in self._parts:
                self._parts[stage] = stage_parts(self.topo.gather_plan, members)
            parts = self._parts[stage]
            t0 = time.perf_counter()
            blobs = []
            for p in parts:
                if p.owner != self.me:
                    continue
                new = self.snapshot.params[p.local][p.region()].detach().to("cpu", p.dtype(self.snapshot.dtype))
                blobs.append(xor_encode(new, self.snapshot.values[p.local][p.region()]))
                stats.elements += p.numel
            stats.encodings["xor+zstd"] += len(blobs)
            stats.pack_s += time.perf_counter() - t0
            mine = _pack_blobs(blobs)
            gathered = gather_stage(group, self.me, members, mine, self.budget, self.credits, self.pool,
                                    self.verify)
            if gathered is None:
                stats.bytes_sent += mine.numel()
                continue
            all_blobs: list[bytes] = []
            for r, payload in zip(members, gathered, strict=True):
                all_blobs += _unpack_blobs(payload, sum(1 for p in parts if p.owner == r))
            stats.bytes_sent += sum(len(b) for b in all_blobs)
            self._write_stage(tmp, stage, parts, all_blobs)
        return stats

    def _write_stage(self, tmp: Path, stage: int, parts: list[Part], blobs: list[bytes]) -> None:
        from safetensors.torch import save_file

        tmp.mkdir(parents=True, exist_ok=True)
        meta = [[p.logical, list(p.offsets), list(p.sizes), xxhash.xxh64_hexdigest(b)]
                for p, b in zip(parts, blobs, strict=True)]
        tensors = {f"p{i}": torch.frombuffer(bytearray(b), dtype=torch.uint8) if b
                   else torch.empty(0, dtype=torch.uint8) for i, b in enumerate(blobs)}
        path = tmp / f"stage{stage}.safetensors"
        raw = {p.logical: p.raw for p in parts if p.raw is not None}  # parts in their own dtype
        save_file(tensors, str(path), metadata={"parts": json.dumps(meta), "dtype": self.topo.wire_dtype,
                                                "raw": json.dumps(raw), "encoding": "xor", "compression": "zstd"})
        _fsync(path)

    def publish(self, version: int, base_version: int,
                before_rename: Callable[[], None] | None = None) -> Path:
        """Trainer rank 0, after every stage wrote: manifest, fsync, atomic rename."""
        tmp, final = _tmp_dir(self.root, version), version_dir(self.root, version)
        stages = [f"stage{s}.safetensors" for s in range(self.topo.trainer.pp)]
        manifest = {"version": version, "base_version": base_version, "encoding": "xor",
                    "compression": "zstd", "checksum": "xxh64", "dtype": self.topo.wire_dtype,
                    "stages": stages}
        missing = [s for s in stages if not (tmp / s).is_file()]
        if missing:
            raise RuntimeError(f"version {version}: stage files {missing} were not written")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        if before_rename is not None:
            before_rename()
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(Path(self.root))
        return final


STAGE_FILE = re.compile(r"stage\d{1,4}\.safetensors")


def read_manifest(root: str | Path, version: int) -> dict:
    """A published version's manifest, checked: stage files are plain names in the version's
    own directory (a ``ValueError`` otherwise), the base version an integer."""
    path = version_dir(root, version) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no published version {version} under {root} (missing {path})")
    manifest = json.loads(path.read_text())
    stages = manifest.get("stages")
    if not isinstance(stages, list) or not all(isinstance(s, str) and STAGE_FILE.fullmatch(s) for s in stages):
        raise ValueError(f"{path}: stages must be names like stage0.safetensors, got {stages!r}")
    if not isinstance(manifest.get("base_version"), int) or manifest.get("version") != version:
        raise ValueError(f"{path}: version {manifest.get('version')!r} / base_version "
                         f"{manifest.get('base_version')!r} do not describe version {version}")
    return manifest


def apply_version(root: str | Path, version: int, current: int, tensors: Mapping[str, torch.Tensor],
                  rank: RankLayout, targets: dict[Part, list] | None = None) -> Stats:
    """Engine side: apply a published delta to this rank's tensors, after checking its base.

    ``targets`` caches where each part lands on this rank across pulls (parts repeat).
    """
    targets = {} if targets is None else targets
    from safetensors import safe_open

    manifest = read_manifest(root, version)
    if manifest["base_version"] != current:
        raise ValueError(f"version {version} is a delta against {manifest['base_version']}, "
                         f"this engine holds {current}; it needs a full update")
    stats = Stats()
    t0 = time.perf_counter()
    dtype = torch_dtype(manifest["dtype"])
    for stage_file in manifest["stages"]:
        with safe_open(str(version_dir(root, version) / stage_file), "pt") as f:
            meta = json.loads(f.metadata()["parts"])
            raw = json.loads(f.metadata().get("raw", "{}"))
            for i, (logical, offsets, sizes, digest) in enumerate(meta):
                own = raw.get(logical)
                if own is not None:
                    torch_dtype(own)  # a dtype name of the closed set, or a ValueError naming it
                part = Part(-1, "", (), logical, tuple(offsets), tuple(sizes), own)
                if part not in targets:
                    targets[part] = targets_for(part, rank)
                where = targets[part]
                if not where:
                    continue
                blob = f.get_tensor(f"p{i}").numpy().tobytes()
                if xxhash.xxh64_hexdigest(blob) != digest:
                    raise ValueError(f"{stage_file} part {i} ({logical}) fails its xxh64 checksum")
                stats.bytes_received += len(blob)
                mask = xor_decode(blob, part.numel, part.dtype(dtype))
                stats.changed += int((mask != 0).sum())
                apply_xor(part, mask, tensors, where, dtype)
    stats.unpack_s = time.perf_counter() - t0
    return stats
