"""Syncing from a PyTorch FSDP2 module: its local shards, read in place, never ``full_tensor()``.

``fsdp2_parallel(module)`` reads the mesh ``fully_shard`` used; ``local_shards(module)`` hands
``WeightSync`` every parameter's ``DTensor.to_local()`` under its HuggingFace name, after
checking the placement is the row split ``layout.fsdp2`` plans for.
"""

from __future__ import annotations

import torch
from torch import nn

from shardsync.layout.fsdp2 import Fsdp2Parallel


def _dtensor():
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor, Replicate, Shard


def fsdp2_parallel(module: nn.Module, *, dtype: str | None = None) -> Fsdp2Parallel:
    """The shard / replicate sizes of ``module``'s ``fully_shard`` mesh (1-D, or 2-D HSDP)."""
    DTensor, _, _ = _dtensor()
    meshes = {p.device_mesh for p in module.parameters() if isinstance(p, DTensor)}
    if len(meshes) != 1:
        raise ValueError(f"expected every parameter sharded by fully_shard on one mesh, found {len(meshes)} meshes; "
                         "call fully_shard on the model (and its layers) with the same mesh first")
    mesh = meshes.pop()
    shape = tuple(mesh.shape)
    if len(shape) == 1:
        return Fsdp2Parallel(shard=shape[0], dtype=dtype)
    if len(shape) == 2:
        return Fsdp2Parallel(shard=shape[1], replicate=shape[0], dtype=dtype)
    raise ValueError(f"FSDP2 meshes are 1-D or 2-D (replicate, shard); got {shape}")


def local_shards(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{HF name: this rank's rows}`` of every parameter, the storage FSDP2 keeps (no copy)."""
    DTensor, Replicate, Shard = _dtensor()
    out = {}
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            raise ValueError(f"{name} is not sharded (a plain tensor): fully_shard every parameter before syncing")
        *rep, last = p.placements
        if last != Shard(0) or any(r != Replicate() for r in rep):
            raise ValueError(f"{name} has placements {p.placements}; shardsync plans FSDP2's (Shard(0),) or "
                             "(Replicate(), Shard(0)) (HSDP)")
        out[name] = p.to_local().detach()
    return out
