"""An engine that serves merged LoRA weights (no LoRA kernel): a sync moves only the adapter's
``A`` and ``B`` into this destination, and ``received`` writes ``W0 + scale * B @ A`` into the
engine's own shard of every adapted base weight (``lora.merge``), in place or into its staging
copy that the wrapped ``commit`` swaps in.

``W0`` is the base the engine loaded, kept: every version merges into it afresh, so the served
weights never drift by the rounding of earlier merges.  The term is computed in float32 from
the rank's own shards (a column target's rows of ``B``, a row target's columns of ``A``): each
element is the full merge's element, up to the order of the rank-``r`` sum and the final
rounding into the engine's dtype.  Checksums read the adapter (what was received); ``stale``
names base tensors whose served values are not the merge of it."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.dtypes import torch_dtype
from shardsync.lora.config import Lora
from shardsync.lora.merge import MergeStep
from shardsync.piece import RankLayout
from shardsync.plan.local import region
from shardsync.receiver.destination import Deriving, Destination


class Merged(Deriving):
    """``inner`` holds the engine's adapted base tensors (live or staged: ``merge_plan``'s
    ``base`` names); ``steps`` the rank's merge, ``adapter`` its adapter layout.  Memory: the
    adapter, and a copy of the adapted base tensors (``W0``)."""

    name = "merged"

    def __init__(self, inner: Destination, steps: tuple[MergeStep, ...], adapter: RankLayout, lora: Lora, *,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(inner)
        self.scale, self.steps = lora.scale, steps
        self._adapter = {t.name: torch.zeros(t.shape, dtype=torch_dtype(t.dtype), device=device)
                         for t in adapter.tensors}
        served = inner.served()
        self._kept = {n: served[n].detach().clone() for n in dict.fromkeys(s.base for s in self.steps)}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._adapter

    def served(self) -> Mapping[str, torch.Tensor]:
        return self._adapter

    def _merged(self, step: MergeStep) -> torch.Tensor:
        a = self._adapter[step.a][:, step.a_cols[0]:step.a_cols[0] + step.a_cols[1]]
        b = self._adapter[step.b][step.b_rows[0]:step.b_rows[0] + step.b_rows[1]]
        kept = self._kept[step.base][region(step.offsets, step.sizes)]
        return (kept.float() + self.scale * (b.float() @ a.float())).to(kept.dtype)

    @torch.no_grad()
    def received(self) -> int:
        """Merge the received adapter into the inner destination; counts the base elements that
        differ from the served ones."""
        into, served = self.inner.tensors(), self.inner.served()
        changed = 0
        for step in self.steps:
            box = region(step.offsets, step.sizes)
            merged = self._merged(step)
            changed += int((served[step.base][box] != merged).sum())
            into[step.base][box].copy_(merged)
        return changed + self.inner.received()

    def unpushable(self) -> str | None:
        return "a merging LoRA engine (it merges what it receives into its base)"

    @torch.no_grad()
    def stale(self) -> set[str]:
        served = self.inner.served()
        bad = [s for s in self.steps if not torch.equal(served[s.base][region(s.offsets, s.sizes)], self._merged(s))]
        return {name for s in bad for name in (s.a, s.b)}  # the received tensors the served base disagrees with
