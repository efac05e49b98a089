"""Adapter layouts: the LoRA tensors alone, as the Megatron trainer, an engine and a full
holder keep them.  Their logical tensors are PEFT's (``model.layers.{L}.<module>.lora_A.weight``),
so an adapter rides the same plans, paths and checks as a model: only these bytes move."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from shardsync.family.cut import Cut, Local
from shardsync.family.table import Supports
from shardsync.layout.base import Layout
from shardsync.layout.cut import cut_rows
from shardsync.layout.engine import EngineParallel
from shardsync.layout.fsdp2 import Fsdp2Parallel, row_blocks
from shardsync.layout.full import full_rank
from shardsync.layout.logical import model_tensors
from shardsync.layout.megatron import MegatronParallel
from shardsync.lora.config import Lora
from shardsync.lora.table import TARGETS
from shardsync.piece import Box, RankLayout, TensorMeta
from shardsync.spec import ModelSpec


def check_lora(spec: ModelSpec, lora: Lora) -> None:
    """Refuse an adapter on layers whose modules it cannot sit on, naming the layer."""
    attention = any(TARGETS[t].attention for t in lora.targets)
    mlp = any(not TARGETS[t].attention for t in lora.targets)
    for layer in range(spec.num_layers):
        block = spec.family_table.blocks(spec, layer)[0]
        if attention and Supports.ADAPTER not in block.supports:
            raise ValueError(f"{spec.name}: layer {layer} has {block.kind} attention, whose block takes no LoRA "
                             "adapter (its Block.supports; grouped-query attention does): drop q/k/v/o_proj from "
                             "the targets")
        if mlp and spec.family_table.is_moe and spec.sparse_layer(layer):
            raise ValueError(f"{spec.name}: layer {layer} is a mixture-of-experts layer; LoRA on routed experts "
                             "is not supported (target the attention modules only)")


@dataclass(frozen=True)
class AdapterPair:
    """One adapted linear: its logical ``A`` and ``B`` and the base weight ``scale * B @ A`` adds to."""

    a: str
    b: str
    weight: str


@functools.lru_cache(maxsize=16)
def adapter_pairs(spec: ModelSpec, lora: Lora) -> tuple[AdapterPair, ...]:
    """Every adapted linear in PEFT's order (layer, then target): who pairs with whom is this
    table's, never read back from the tensors' names."""
    check_lora(spec, lora)
    return tuple(AdapterPair(pre + t.a, pre + t.b, pre + t.module + ".weight")
                 for layer in range(spec.num_layers) for pre in (f"model.layers.{layer}.",)
                 for t in (TARGETS[name] for name in lora.targets))


@functools.lru_cache(maxsize=16)
def adapter_tensors(spec: ModelSpec, lora: Lora) -> dict[str, Box]:
    """Every adapter tensor in PEFT's order (layer, then target, ``A`` before ``B``); shared by
    the layouts of this adapter, never changed in place."""
    base = model_tensors(spec)
    out: dict[str, Box] = {}
    for pair in adapter_pairs(spec, lora):
        rows, cols = base[pair.weight]
        out[pair.a] = (lora.rank, cols)
        out[pair.b] = (rows, lora.rank)
    return out


def _rank(spec: ModelSpec, lora: Lora, label: str, layers: list[tuple[int, str]], tp: int, r: int,
          megatron: bool, dtype: str) -> RankLayout:
    logical = adapter_tensors(spec, lora)
    made: list[Local] = []
    for layer, local in layers:
        c = Cut(spec, layer, local, tp, r, logical)
        rows = [row for name in lora.targets for row in TARGETS[name].rows(megatron)]
        made += [m for m, _ in cut_rows(rows, c)]
    return RankLayout(label, tuple(TensorMeta(m.name, m.shape, dtype) for m in made),
                      tuple(p for m in made for p in m.pieces))


def megatron_adapter_layout(spec: ModelSpec, lora: Lora, par: MegatronParallel) -> Layout:
    """The trainer's adapter shards (fp32 masters unless ``par.dtype``), Megatron's rank order."""
    dtype = par.dtype or spec.dtype
    stages = par.stage_layers(spec.num_layers)
    cache: dict[tuple[int, int], RankLayout] = {}
    ranks = []
    for g in range(par.world_size):
        s, dp_rank, r = par.coords(g)
        if (s, r) not in cache:
            layers = [(layer, f"decoder.layers.{i}.") for i, layer in enumerate(stages[s])]
            cache[s, r] = _rank(spec, lora, "", layers, par.tp, r, True, dtype)
        held = cache[s, r]
        ranks.append(RankLayout(f"pp{s}.dp{dp_rank}.tp{r}", held.tensors, held.pieces))
    return Layout("megatron-lora", spec, adapter_tensors(spec, lora), tuple(ranks),
                  (("tp", par.tp), ("pp", par.pp), ("dp", par.dp), ("lora", lora.rank)))


def fsdp2_adapter_layout(spec: ModelSpec, lora: Lora, par: Fsdp2Parallel) -> Layout:
    """An FSDP2 trainer's adapter (PEFT on the transformers model, under ``fully_shard``): every
    adapter tensor split by rows over the shard group, as its other parameters are."""
    logical = adapter_tensors(spec, lora)
    return row_blocks(spec, par, logical, logical, lora=lora.rank)


def engine_adapter_layout(spec: ModelSpec, lora: Lora, par: EngineParallel) -> Layout:
    """One engine's adapter tensors per rank (stage-major), under PEFT's names: a column target's
    ``B`` split by rows like its base weight, a row target's ``A`` by columns."""
    dtype = par.dtype or spec.dtype
    if par.whole:
        return full_adapter_layout(spec, lora, replicas=par.world_size, dtype=dtype)
    kv = any(t in lora.targets for t in ("k_proj", "v_proj"))
    if kv and par.tp > spec.num_kv_heads:
        raise ValueError(f"engine TP {par.tp} > num_kv_heads {spec.num_kv_heads} replicates KV heads; their LoRA "
                         "B rows are not split that way yet: use engine TP <= num_kv_heads or drop k/v_proj")
    ranks = []
    for s in range(par.pp):
        layers = [(layer, f"model.layers.{layer}.") for layer in par.stage_layers(spec.num_layers, s)]
        for r in range(par.tp):
            ranks.append(_rank(spec, lora, f"pp{s}tp{r}" if par.pp > 1 else f"tp{r}", layers, par.tp, r, False,
                               dtype))
    return Layout("engine-lora", spec, adapter_tensors(spec, lora), tuple(ranks),
                  (("tp", par.tp), ("lora", lora.rank)) + ((("pp", par.pp),) if par.pp > 1 else ()))


def full_adapter_layout(spec: ModelSpec, lora: Lora, *, replicas: int = 1, dtype: str | None = None) -> Layout:
    """``replicas`` holders of the whole adapter (broadcast receivers, an adapter directory)."""
    logical = adapter_tensors(spec, lora)
    one = full_rank("full0", list(logical), logical, dtype or spec.dtype)
    ranks = tuple(RankLayout(f"full{i}", one.tensors, one.pieces) for i in range(replicas))
    return Layout("full", spec, logical, ranks, (("replicas", replicas), ("lora", lora.rank)))
