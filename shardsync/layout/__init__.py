"""Layouts: which pieces of which logical (HF) tensors every rank holds."""

from shardsync.layout.base import Layout, concat_layouts
from shardsync.layout.engine import EngineParallel, engine_layout
from shardsync.layout.fsdp2 import Fsdp2Parallel, fsdp2_layout
from shardsync.layout.full import full_layout, stage_sources
from shardsync.layout.logical import logical_tensors
from shardsync.layout.megatron import MegatronParallel, megatron_layout
from shardsync.piece import Piece, RankLayout, TensorMeta

__all__ = [
    "EngineParallel",
    "Fsdp2Parallel",
    "Layout",
    "MegatronParallel",
    "Piece",
    "RankLayout",
    "TensorMeta",
    "concat_layouts",
    "engine_layout",
    "fsdp2_layout",
    "full_layout",
    "logical_tensors",
    "megatron_layout",
    "stage_sources",
]
