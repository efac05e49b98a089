"""Initial weights for both reference models, always through plans (never hand slicing).

Sources of logical (HF) tensors: random from a seed (each tensor from its own generator,
so every rank of every TP size sees the same values), or a safetensors checkpoint dir.
``load_rank`` cuts one rank's local tensors out of either with the full -> layout plan.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from shardsync.dtypes import torch_dtype
from shardsync.layout import Layout
from shardsync.layout.full import full_rank
from shardsync.plan import build_plan
from shardsync.plan.local import region
from shardsync.spec import ModelSpec

TensorSource = Callable[[str], torch.Tensor]


def random_source(spec: ModelSpec, seed: int = 0, *, std: float = 0.02,
                  shapes: dict[str, tuple[int, ...]] | None = None) -> TensorSource:
    """Deterministic random logical tensors: norms near 1, everything else N(0, std); a tensor an
    engine holds narrower than float32 (SGLang's bfloat16 indexer ``weights_proj``) holds values
    that dtype represents, as a checkpoint in it would.  ``shapes``: tensors beside the model's
    (a LoRA adapter's, ``lora.adapter_tensors``)."""
    from shardsync.layout.raw import narrow_dtypes

    narrow = narrow_dtypes(spec, frozenset(), "float32")

    def get(name: str) -> torch.Tensor:
        shape = shapes[name] if shapes is not None and name in shapes else logical_shape(spec, name)
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t = 1.0 + 0.1 * t
        else:
            t = t * (std * 5 if name.endswith(".bias") else std)
        return t.to(torch_dtype(narrow[name])).float() if name in narrow else t
    return get


def sparse_change(source: TensorSource, tag: int, *, density: float = 0.01, scale: float = 0.05) -> TensorSource:
    """``source`` with about ``density`` of every tensor's elements moved (what an RL step
    with a small learning rate changes, and what a delta update carries), seeded by ``tag``."""
    def get(name: str) -> torch.Tensor:
        t = source(name).clone()
        digest = hashlib.sha256(f"change:{tag}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        mask = torch.rand(t.shape, generator=g) < density
        t[mask] += scale * torch.randn(int(mask.sum()), generator=g)
        return t
    return get


def logical_shape(spec: ModelSpec, name: str) -> tuple[int, ...]:
    from shardsync.layout.logical import logical_tensors
    return logical_tensors(spec)[name]


def checkpoint_source(path: str | Path) -> TensorSource:
    """Tensors of a HF safetensors checkpoint directory (single file or sharded index)."""
    from safetensors import safe_open

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{root}: no *.safetensors files; pass a HF checkpoint directory")
        weight_map = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                weight_map.update({k: f.name for k in h.keys()})

    def get(name: str) -> torch.Tensor:
        file = weight_map.get(name)
        if file is None and name == "lm_head.weight":
            raise ValueError(f"{root}: no lm_head.weight but config says untied embeddings")
        if file is None:
            raise ValueError(f"{root}: checkpoint has no tensor {name!r}")
        with safe_open(str(root / file), "pt") as h:
            return h.get_tensor(name)
    return get


def load_rank(layout: Layout, rank: int, source: TensorSource, *,
              device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Rank ``rank``'s local tensors (layout dtype), padding zero, filled from ``source``."""
    names = list(layout.logical)
    full = Layout("full", layout.spec, layout.logical, (full_rank("full0", names, layout.logical, "float32"),))
    plan = build_plan(full, layout)
    out = {
        t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device)
        for t in layout.ranks[rank].tensors
    }
    mine = plan.copies_to(rank)
    left = Counter(c.logical for c in mine)  # a logical tensor is dropped after its last copy
    cache: dict[str, torch.Tensor] = {}
    for c in mine:
        if c.logical not in cache:
            cache[c.logical] = source(c.logical)
        src = cache[c.logical][region(c.src_offsets, c.sizes)]
        out[c.dst_local][region(c.dst_offsets, c.sizes)].copy_(src)
        left[c.logical] -= 1
        if not left[c.logical]:
            del cache[c.logical]
    return out
