"""LoRA in both reference models: one rank's adapter tensors under their layout names, and
the low-rank term each adapted linear adds, ``scale * (x @ A.T) @ B.T``.

The term is computed on the rank's shard as the base linear is: a column-parallel target adds
its rows of the output (``A`` whole, ``B`` the rank's rows); a row-parallel one adds a partial
sum (``A`` the rank's columns, ``B`` whole) that the base linear's all-reduce completes."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shardsync.dtypes import torch_dtype
from shardsync.lora import TARGETS, Lora, adapter_tensors
from shardsync.piece import RankLayout
from shardsync.spec import ModelSpec


class LoraWeights(nn.Module):
    """The adapter tensors of one rank (``lora.layout``), as parameters named by the layout
    (``get_parameter(name)``), zeroed; ``trainable``: a trainer's (fp32 masters, gradients)."""

    def __init__(self, rl: RankLayout, device: torch.device, *, trainable: bool = False) -> None:
        super().__init__()
        made: dict[tuple[str, ...], nn.Module] = {(): self}  # the container modules, by path
        for t in rl.tensors:
            *path, attr = t.name.split(".")
            for i in range(1, len(path) + 1):
                if tuple(path[:i]) not in made:
                    made[tuple(path[:i])] = nn.Module()
                    made[tuple(path[:i - 1])].add_module(path[i - 1], made[tuple(path[:i])])
            owner = made[tuple(path)]
            data = torch.zeros(t.stored, dtype=torch_dtype(t.dtype), device=device)
            owner.register_parameter(attr, nn.Parameter(data, requires_grad=trainable))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> parameter: what a receiver writes (or a sync reads)."""
        return dict(self.named_parameters())


# (weight, replicated over TP) -> what the math reads: the trainer casts to its compute dtype and
# sums a replicated weight's gradient over TP (each rank's term sees only its shard)
Cast = Callable[[torch.Tensor, bool], torch.Tensor]


class LoraTerm:
    """One layer's adapted linears on one rank: ``add(target, x, y)`` returns ``y`` plus the
    target's low-rank term (``y`` itself where the adapter has no such target).  ``names``: the
    target's (A, B) local names, formatted from the layer's prefix; ``cast``: what the math reads
    each weight through (the trainer's compute dtype and TP gradient functions)."""

    def __init__(self, weights: LoraWeights, lora: Lora, names: dict[str, tuple[str, str]],
                 cast: Cast | None = None) -> None:
        self.weights, self.scale, self.names = weights, lora.scale, names
        self.cast: Cast = cast or (lambda w, replicated: w)

    def add(self, target: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        pair = self.names.get(target)
        if pair is None:
            return y
        column = TARGETS[target].column  # A whole on every rank (else B)
        a = self.cast(self.weights.get_parameter(pair[0]), column)
        b = self.cast(self.weights.get_parameter(pair[1]), not column)
        return y + self.scale * F.linear(F.linear(x, a), b)


def engine_terms(weights: LoraWeights, lora: Lora, layer: int) -> LoraTerm:
    """Layer ``layer``'s adapted linears on an engine rank (PEFT's names)."""
    pre = f"model.layers.{layer}."
    return LoraTerm(weights, lora, {n: (pre + TARGETS[n].a, pre + TARGETS[n].b) for n in lora.targets})


def trainer_terms(weights: LoraWeights, lora: Lora, local: str, cast: Cast) -> LoraTerm:
    """A trainer layer's adapted linears under Megatron's adapter names (``local``: the layer's
    prefix, ``decoder.layers.{i}.``)."""
    names = {n: (f"{local}{TARGETS[n].megatron}.linear_in.weight", f"{local}{TARGETS[n].megatron}.linear_out.weight")
             for n in lora.targets}
    return LoraTerm(weights, lora, names, cast)


def initial_adapter(spec: ModelSpec, lora: Lora, seed: int) -> Callable[[str], torch.Tensor]:
    """PEFT's initial adapter as a tensor source: ``A`` uniform in +-1/sqrt(fan_in) (its
    ``kaiming_uniform_(a=sqrt(5))``), ``B`` zero, so the adapted model starts as the base;
    seeded per tensor, so every TP rank cuts the same values."""
    shapes = adapter_tensors(spec, lora)

    def get(name: str) -> torch.Tensor:
        rows, cols = shapes[name]
        if ".lora_B." in name:
            return torch.zeros(rows, cols)
        digest = hashlib.sha256(f"lora:{seed}:{name}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
        return (torch.rand(rows, cols, generator=g) * 2 - 1) / math.sqrt(cols)
    return get
