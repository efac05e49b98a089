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
    from shardsync.models.training import grpo_loss

    old = model.policy_logprobs(ids)
    mask = torch.ones(ids.shape[0], ids.shape[1] - 1)
    model.train_step(ids, functools.partial(grpo_loss, old_logprobs=old, mask=mask,
                                            advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])))


def lora_trainer(spec: ModelSpec, lora: Lora, rank: int, world: int, port: int, *, adapter_seed: int = 3):
    """In a spawned rank: join the default group (gloo) and build the TP ``world`` reference LoRA
    trainer on the base of seed 0 (AdamW, lr 1e-3), its adapter from seed ``adapter_seed``.
    Returns (the trainer, its ``MegatronParallel``)."""
    import datetime

    import torch.distributed as dist

    from shardsync.layout import MegatronParallel
    from shardsync.lora import adapter_tensors
    from shardsync.models.trainer import TrainerModel, megatron_groups
    from shardsync.models.training import OptimConfig
    from shardsync.models.weights import random_source

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    par = MegatronParallel(tp=world, dtype="float32")
    groups = megatron_groups(par)
    model = TrainerModel(spec, par, rank, groups.tp, groups.pp, source=random_source(spec, 0),
                         optim=OptimConfig(lr=1e-3), lora=lora)
    model.load_adapter(random_source(spec, adapter_seed, shapes=adapter_tensors(spec, lora)))
    return model, par


def whole_model_refusal(spec: ModelSpec, par, rank: int, model, urls: list[str], cfg) -> str:
    """What a whole-model connect of ``model`` into adapter engines answers (``cfg``: its
    ``SyncConfig``); fails the test when it connects."""
    import torch.distributed as dist

    from shardsync.control.client import SyncError
    from shardsync.sync import WeightSync

    whole = WeightSync(spec, par, rank, dict(model.named_parameters()), urls, cfg, trainer_group=dist.group.WORLD)
    try:
        whole.connect()
    except SyncError as e:
        return str(e)
    raise AssertionError("a whole-model sync connected to engines serving an adapter")
