"""The adapter reference the LoRA tests check engines against: transformers + PEFT's
``LoraConfig`` on the base, holding a given adapter (PEFT's checkpoint names)."""

from __future__ import annotations

import torch

from shardsync.lora import Lora, from_peft
from shardsync.models.weights import TensorSource
from shardsync.spec import ModelSpec


@torch.no_grad()
def peft_model(spec: ModelSpec, base: TensorSource, lora: Lora, adapter: dict[str, torch.Tensor]) -> torch.nn.Module:
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    for name, param in hf.named_parameters():
        param.copy_(base(name))
    model = get_peft_model(hf, LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.targets),
                                          init_lora_weights=False)).eval()
    for name, param in model.named_parameters():
        if param.requires_grad:  # the adapter's (PEFT freezes the base)
            param.copy_(adapter[from_peft(name)])
    return model
