"""LoRA adapters: what an adapter is (``config``), the modules it targets (``table``) and its
layouts on trainer and engines (``layout``)."""

from shardsync.lora.config import ALL_LINEAR, Lora
from shardsync.lora.layout import (
    adapter_tensors,
    check_lora,
    engine_adapter_layout,
    fsdp2_adapter_layout,
    full_adapter_layout,
    megatron_adapter_layout,
)
from shardsync.lora.table import TARGETS, Target, from_peft

__all__ = ["ALL_LINEAR", "TARGETS", "Lora", "Target", "adapter_tensors", "check_lora", "engine_adapter_layout",
           "from_peft", "fsdp2_adapter_layout", "full_adapter_layout", "megatron_adapter_layout"]
