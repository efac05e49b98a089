"""An FSDP2 trainer the way verl/prime-rl/TRL run one: a real ``transformers`` model under
``fully_shard`` (each decoder layer, then the root) with AdamW, every rank a DP replica with
its own rows.  It offers what the GRPO loop calls on the reference trainer
(``policy_logprobs``, ``train_step``) and, for the sync, ``local_shards``: nothing else is
shardsync's; the point is that a sync reads FSDP2's own shards.  With ``lora``, PEFT's
``LoraConfig`` wraps the model first (the base frozen, AdamW on the adapter) and the sync reads
the adapter's shards alone (``adapter_shards``).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from shardsync.fsdp2 import local_shards
from shardsync.layout.fsdp2 import Fsdp2Parallel
from shardsync.lora import Lora, from_peft
from shardsync.models.lora import initial_adapter
from shardsync.models.training import LossFn, OptimConfig, StepStats
from shardsync.models.weights import TensorSource
from shardsync.spec import ModelSpec


class Fsdp2Trainer:
    """Collective over the default group: every rank calls each method in the same order."""

    def __init__(self, spec: ModelSpec, par: Fsdp2Parallel, source: TensorSource, *,
                 optim: OptimConfig | None = None, lora: Lora | None = None, lora_seed: int = 0) -> None:
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if spec.is_moe:
            raise ValueError("FSDP2 MoE trainers are not supported: transformers 5 stacks a layer's experts in "
                             "one parameter, not the checkpoint's per-expert tensors shardsync plans")
        self.spec, self.par = spec, par
        cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(source(name))
        layers = model.model.layers
        root: nn.Module = model
        self.lora = lora
        if lora is not None:  # PEFT's LoRA, started from PEFT's init as every rank draws it alike
            from peft import LoraConfig, get_peft_model

            # PEFT scales by alpha / r in floats; its field's annotation says int
            root = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,  # type: ignore[arg-type]
                                                    target_modules=list(lora.targets)))
            start = initial_adapter(spec, lora, lora_seed)
            with torch.no_grad():
                for name, p in root.named_parameters():
                    if p.requires_grad:
                        p.copy_(start(from_peft(name)))
        shape = (par.shard,) if par.replicate == 1 else (par.replicate, par.shard)
        names = ("shard",) if par.replicate == 1 else ("replicate", "shard")
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        # ``root`` itself, its class extended with FSDPModule (the stubs return only the latter)
        self.model = cast(nn.Module, fully_shard(root, mesh=mesh))
        o = optim or OptimConfig()
        self.optim_config = o
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=o.lr, betas=o.betas, eps=o.eps,
                                           weight_decay=o.weight_decay)

    def local_shards(self) -> dict[str, torch.Tensor]:
        return local_shards(self.model)

    def synced(self) -> dict[str, torch.Tensor]:
        """What a sync reads on this rank: the model's shards, or the adapter's alone when it
        trains one."""
        return self.local_shards() if self.lora is None else self.adapter_shards()

    def adapter_shards(self) -> dict[str, torch.Tensor]:
        """This rank's rows of every adapter tensor, under PEFT's checkpoint names (what an adapter
        sync reads: ``lora.fsdp2_adapter_layout``)."""
        assert self.lora is not None, "adapter_shards needs a trainer built with lora="
        trained = {id(p) for p in self.trained}
        params = dict(self.model.named_parameters())
        return {from_peft(n): t for n, t in local_shards(self.model).items() if id(params[n]) in trained}

    def _logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(ids).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    @torch.no_grad()
    def policy_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._logprobs(input_ids)

    def train_step(self, input_ids: torch.Tensor, loss_fn: LossFn, *, lr: float | None = None) -> StepStats:
        """Forward, backward (FSDP2 reduce-scatters the mean gradient over every rank), clip, AdamW."""
        loss = loss_fn(self._logprobs(input_ids))
        loss.backward()
        limit = self.optim_config.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.trained, limit if limit is not None else float("inf"))
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        return StepStats(loss=float(total) / torch.distributed.get_world_size(), grad_norm=float(norm))
