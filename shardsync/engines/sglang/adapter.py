"""The adapter view's SGLang side: an adapter sync lands whole in a ``Loader`` whose commit
replaces the weights of the adapter directory SGLang serves (``ENV_LORA_DIR``; TP rank 0
writes), and the trainer's client then has SGLang reload it (``control.sglang``).  SGLang's
LoRA manager shards an adapter per TP rank itself, so shards are refused with that reason
(the trainer plans whole tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shardsync.control.hosted import LAYOUT_MISMATCH
from shardsync.control.sglang import ENV_LORA_DIR
from shardsync.lora import Lora
from shardsync.receiver import Receiver, peft_dir
from shardsync.spec import ModelSpec
from shardsync.vocab import Reason, Refused


@dataclass
class Adapters:
    """One SGLang rank's adapter receivers, by the adapter's config (built once each)."""

    spec: ModelSpec
    tp_rank: int
    tp_size: int
    pp: int
    dtype: torch.dtype
    secret: str
    made: dict[Lora, Receiver] = field(default_factory=dict)

    def receiver(self, whole: bool, lora: Lora | None) -> Receiver | None:
        """The receiver of a sync of ``lora`` (None: the sync is the whole model's, not an adapter's)."""
        if lora is None:
            return None
        root = peft_dir.served_dir(ENV_LORA_DIR, "SGLang", "--lora-paths")
        if self.pp > 1:
            raise ValueError("adapter syncs into SGLang run at PP 1 only")
        if not whole:
            raise Refused(f"SGLang's {LAYOUT_MISMATCH}: its LoRA manager takes the whole adapter and shards it "
                          "itself", Reason.LAYOUT_MISMATCH)
        if lora not in self.made:
            self.made[lora] = peft_dir.adapter_receiver(self.spec, self.tp_rank, self.tp_size, root, lora,
                                                        dtype=self.dtype, secret=self.secret, engine="SGLang")
        return self.made[lora]
