"""vLLM-CPU's MoE experts across a weight reload.

At start vLLM's unquantized MoE method hands the loaded expert weights to its experts'
``process_weights_after_loading``; on CPU (``CPUUnquantizedExperts`` and its x86/Arm/Power
subclasses) that repacks ``w13_weight``/``w2_weight`` into the grouped-GEMM layout
(``cpu_prepack_moe_weight``, same shape).  On a reload the method sees its kernel already
built and skips that hook (``UnquantizedFusedMoEMethod._setup_kernel``: only the first call
runs it), so the layerwise reload leaves raw, unpacked values in the prepacked parameters
and the MoE output is wrong while every shape and checksum looks fine.  The loader path
runs the hook again on every expert layer the reload wrote (``repack_reloaded``), which
is what vLLM's own start runs on those weights.

The hook also zero-pads the intermediate size to the kernel's alignment; a padded layer
cannot take a reload at all (vLLM copies the unpadded values into the padded parameter),
so such an engine is refused at connect (``padding_problem``).  Experts of other backends
(GPU) whose hook captures configuration only are left as vLLM's reload leaves them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardsync.engines.vllm.params import at_load_shapes

WEIGHTS = ("w13_weight", "w2_weight")  # what the CPU experts' hook repacks


@dataclass(frozen=True)
class CpuExperts:
    name: str  # the module's name in vLLM's model
    layer: torch.nn.Module  # vLLM's routed-experts layer (the parameters' owner)
    experts: Any  # vLLM's CPUUnquantizedExperts of that layer (its hook repacks)


def cpu_experts(model: torch.nn.Module) -> list[CpuExperts]:
    """Every MoE layer whose experts are vLLM-CPU's unquantized kernel."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    out = []
    for name, mod in model.named_modules():
        # vLLM's routed-experts layer, its MoE method (``moe_kernel`` declared on the base) and
        # the kernel's experts
        if not isinstance(mod, RoutedExperts) or not isinstance(mod.quant_method, FusedMoEMethodBase):
            continue
        kernel = mod.quant_method.moe_kernel
        if kernel is not None and isinstance(kernel.fused_experts, CPUUnquantizedExperts):
            out.append(CpuExperts(name, mod, kernel.fused_experts))
    return out


def padding_problem(model: torch.nn.Module) -> str | None:
    """Why a reload cannot write this engine's experts, or None: vLLM-CPU padded them."""
    shapes = at_load_shapes(model)
    for e in cpu_experts(model):
        for w in WEIGHTS:
            loaded, live = shapes.get(f"{e.name}.{w}"), tuple(e.layer.get_parameter(w).shape)
            if loaded is not None and loaded != live:
                return (f"vLLM-CPU's MoE kernel padded {e.name}.{w} from {list(loaded)} to {list(live)} (the "
                        "expert intermediate size per TP rank is not a multiple of its alignment) and vLLM's "
                        "weight reload cannot write a padded expert; choose a TP size or model whose "
                        "moe_intermediate_size / TP is a multiple of 32")
    return None


def reloaded(layers: list[CpuExperts]) -> list[CpuExperts]:
    """The layers this reload wrote (any of their weights arrived), read from vLLM's
    layerwise-reload state before ``finalize_layerwise_reload`` resets it: a layer loaded
    whole was processed already (its state reset), a part-loaded one has elements counted;
    an untouched one keeps its prepacked values and must not be repacked twice."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = []
    for e in layers:
        info = get_layerwise_info(e.layer)
        if not (info.can_load() and info.load_numel == 0):
            out.append(e)
    return out


def repack(layers: list[CpuExperts]) -> None:
    """Run each layer's experts hook, as vLLM's start does on freshly loaded weights."""
    for e in layers:
        e.experts.process_weights_after_loading(e.layer)  # vLLM's declared experts hook
