"""A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) as an
adapter engine's destination: engines that load adapters from a path by name (vLLM's
``--lora-modules NAME=DIR``) read each new version from the directory shardsync replaces.

The commit writes the received adapter beside the old file and renames it over it, so a
reader sees one version or the other, never a mix; a failed or cut receive leaves the old
file.  Names are PEFT's own (``base_model.model.<module>.lora_A.weight``), so transformers +
PEFT load the directory as they load a checkpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from shardsync.dtypes import dtype_name
from shardsync.lora import Lora
from shardsync.plan.local import region
from shardsync.receiver.destination import Loader, Slice
from shardsync.receiver.receiver import Receiver, engine_rank
from shardsync.spec import ModelSpec
from shardsync.views import views_of

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20  # an adapter config is a few hundred bytes; a bigger file is not one


def served_dir(variable: str, engine: str, entry: str) -> str:
    """The adapter directory an engine serves, as its environment names it (``variable``);
    ValueError naming the variable and the engine's own flag (``entry``) when it is not set."""
    root = os.environ.get(variable)
    if not root:
        raise ValueError(f"{engine} serves LoRA adapters but {variable} is not set in its environment: set it to "
                         f"the directory of the one {entry} entry shardsync syncs (docs/lora.md)")
    return root


def read_config(root: str | Path) -> Lora:
    """The adapter a directory holds, from its ``adapter_config.json`` (plain LoRA only)."""
    path = Path(root) / CONFIG
    if not path.is_file():
        raise ValueError(f"{path} does not exist: the adapter directory holds a PEFT adapter (save the trainer's "
                         "initial adapter there with PEFT's save_pretrained or write_dir)")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path} is over {MAX_CONFIG_BYTES} bytes: not an adapter config")
    cfg = json.loads(path.read_text())
    targets = cfg.get("target_modules")
    if not isinstance(targets, list):
        raise ValueError(f"{path}: target_modules must be a list of module names (a regex is not supported), "
                         f"got {targets!r}")
    unsupported = [k for k in ("use_rslora", "use_dora") if cfg.get(k)]
    if unsupported or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError(f"{path}: {unsupported or 'per-module rank/alpha patterns'} are not supported "
                         "(shardsync syncs plain LoRA: one rank and alpha for every target)")
    return Lora(int(cfg["r"]), float(cfg["lora_alpha"]), tuple(str(t) for t in targets))


def config_of(lora: Lora) -> dict[str, object]:
    """PEFT's ``adapter_config.json`` for ``lora`` (what vLLM's and PEFT's loaders read)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
            "target_modules": list(lora.targets), "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
            "use_dora": False, "base_model_name_or_path": None}


def _replace(path: Path, write: Callable[[str], object]) -> None:
    """``write`` a temporary file in ``path``'s directory, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_weights(root: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the directory's weights file with ``tensors`` (logical adapter names)."""
    from safetensors.torch import save_file

    named = {PEFT_PREFIX + n: t.detach().contiguous().cpu() for n, t in tensors.items()}
    _replace(Path(root) / WEIGHTS, lambda p: save_file(named, p))


def write_dir(root: str | Path, lora: Lora, tensors: dict[str, torch.Tensor]) -> None:
    """A PEFT adapter directory of ``lora`` holding ``tensors`` (an engine's first version)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _replace(root / CONFIG, lambda p: Path(p).write_text(json.dumps(config_of(lora), indent=1)))
    write_weights(root, tensors)


def writer(root: str | Path, *, write: bool = True) -> Callable[[Iterator[Slice]], None]:
    """A ``Loader``'s load: the received whole adapter replaces the weights file in ``root`` (its
    config was checked at connect and stays; ``write=False``: a rank whose peer writes the same
    bytes only drains its slices)."""

    def load(slices: Iterator[Slice]) -> None:
        tensors: dict[str, torch.Tensor] = {}
        for s in slices:
            if tuple(s.tensor.shape) == s.full_shape:
                tensors[s.name] = s.tensor
                continue
            full = tensors.setdefault(s.name, torch.zeros(s.full_shape, dtype=s.tensor.dtype))
            full[region(s.offsets, tuple(s.tensor.shape))] = s.tensor
        if write:
            write_weights(root, tensors)

    return load


def read_weights(root: str | Path) -> dict[str, torch.Tensor]:
    """The adapter tensors a directory holds, under their logical names (safetensors: no pickle)."""
    from safetensors.torch import load_file

    return {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(str(Path(root) / WEIGHTS)).items()}


def adapter_receiver(spec: ModelSpec, tp_rank: int, tp_size: int, root: str | Path, lora: Lora, *,
                     dtype: torch.dtype, secret: str, engine: str) -> Receiver:
    """One rank of an engine that loads its adapter from ``root``: the whole adapter (the engine
    shards it per TP rank itself) into a ``Loader`` whose commit replaces the directory's weights
    (TP rank 0 writes; every rank received the same bytes).  Refuses, naming ``engine``, an
    adapter other than the one the directory holds."""
    served = read_config(root)
    if served != lora:
        raise ValueError(f"the trainer syncs adapter {lora}, {engine}'s adapter directory {root} holds adapter "
                         f"{served}: start {engine} on an adapter of the trainer's rank, alpha and targets")
    views = views_of(None, lora)
    layout, rank = engine_rank(spec, tp_rank, tp_size, dtype_name=dtype_name(dtype), whole=True, views=views)
    dest = Loader(rank, layout.logical, writer(root, write=tp_rank == 0), dtype=dtype, device="cpu")
    return Receiver(spec, tp_rank, tp_size, dest, dtype=dtype, device="cpu", secret=secret, whole=True, views=views)
