"""The adapter view's vLLM side: a vLLM serving a LoRA adapter (``--enable-lora --lora-modules
NAME=DIR`` with ``SHARDSYNC_VLLM_LORA_DIR=DIR``) takes syncs of that adapter alone, whole on
every worker (vLLM's LoRA layers shard it themselves), into the directory vLLM reloads it
from (``receiver.peft_dir``).  The backend asks ``served`` which way in a worker has."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardsync.control.vllm import ENV_LORA_DIR
from shardsync.lora import Lora
from shardsync.receiver import Receiver, peft_dir
from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class AdapterDirectory:
    """One worker's way in when vLLM serves an adapter: the whole adapter into ``root``."""

    spec: ModelSpec
    tp_rank: int
    tp_size: int
    root: str
    dtype: torch.dtype
    secret: str

    name = "adapter directory"
    layout_reason: str | None = "vLLM's LoRA layers take the whole adapter and shard it themselves"

    def receiver(self, whole: bool, lora: Lora | None) -> Receiver:
        if lora is None:
            raise ValueError("this vLLM serves a LoRA adapter (--enable-lora): shardsync syncs that adapter "
                             "alone; connect with SyncConfig(lora=...) of its rank, alpha and targets")
        return peft_dir.adapter_receiver(self.spec, self.tp_rank, self.tp_size, self.root, lora, dtype=self.dtype,
                                         secret=self.secret, engine="vLLM")


def served(lora_config: object | None, spec: ModelSpec, tp_rank: int, tp_size: int, dtype: torch.dtype,
           secret: str) -> AdapterDirectory | None:
    """The adapter directory this worker syncs (``lora_config``: vLLM's; None: vLLM serves no
    adapter, so the worker takes the whole model)."""
    if lora_config is None:
        return None
    root = peft_dir.served_dir(ENV_LORA_DIR, "vLLM (--enable-lora)", "--lora-modules")
    return AdapterDirectory(spec, tp_rank, tp_size, root, dtype, secret)


def whole_model(lora: Lora | None) -> None:
    """Refuse an adapter sync into a vLLM that serves none."""
    if lora is not None:
        raise ValueError("this vLLM serves no LoRA adapter: start it with --enable-lora --max-lora-rank R "
                         f"--lora-modules NAME=DIR and {ENV_LORA_DIR}=DIR to sync an adapter (docs/lora.md)")
