"""The adapter reference the LoRA tests check engines against: transformers + PEFT's
``LoraConfig`` on the base, holding a given adapter (PEFT's checkpoint names)."""

from __future__ import annotations

import functools

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


def peft_greedy(spec: ModelSpec, base: TensorSource, lora: Lora, adapter: dict[str, torch.Tensor],
                prompts, new: int) -> list[tuple[list[int], list[float]]]:
    """The PEFT model's greedy continuation of each prompt and the logprob of each chosen token."""
    model = peft_model(spec, base, lora, adapter)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            seq, lps = list(prompt), []
            for _ in range(new):
                logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
                tok = int(logp.argmax())
                seq.append(tok)
                lps.append(float(logp[tok]))
            out.append((seq[len(prompt):], lps))
    return out


def grpo_step(model, ids: torch.Tensor) -> None:
    """One GRPO step on ``ids`` (4 sequences) with fixed advantages: the LoRA tests' training
    between syncs (``model``: the reference trainer or the FSDP2 one)."""
    from shardsync.models.trainer import grpo_loss

    old = model.policy_logprobs(ids)
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)
    model.train_step(ids, functools.partial(grpo_loss, old_logprobs=old, mask=mask,
                                            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])))
