"""An FP8 engine's receive.  Weights the plans carry quantized (``quant.wire``: their blocks lie
in one trainer shard) land as e4m3 words and scales straight in the served tensors (or their
staging).  The others land in a model-dtype copy of them, and the rank quantizes its own shard
(``quant.fp8``) into what it serves.

The copy is the engine's shard of the trainer's weights, kept across updates (a delta
applies to it); ``received`` quantizes it right after a receive, off the engine's pause,
into the wrapped destination (the live FP8 weights in place, or their staging copy that
the wrapped ``commit`` swaps in).  Every quantized block lies within one piece
(``quant.targets``), so the result equals the engine's quantizer on the full tensor.
Checksums read the copy (what was received); ``stale`` names weights whose served FP8
bytes or scales are not the quantization of it (a stale scale is caught there).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardsync.layout.piece import RankLayout
from shardsync.quant.fp8 import Fp8Format, quantize
from shardsync.quant.targets import Target
from shardsync.quant.wire import WORD
from shardsync.receiver.destination import Deriving, Destination


class Quantized(Deriving):
    """``inner`` holds the engine's served tensors (FP8 weights, their scales, the rest);
    ``targets`` the quantized ones (``quant.quantized``).  Memory: a model-dtype copy of the
    rank's quantized weights that arrive wide, made when first addressed (a connection
    ``bind``s first: the weights it carries quantized need none)."""

    name = "quantized"

    def __init__(self, inner: Destination, targets: Mapping[str, Target], fmt: Fp8Format, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        staged = inner.staged()
        if staged is not None and not staged.whole:
            raise ValueError("an FP8 engine stages whole shards or receives in place; a staging window "
                             "(--staging-bytes below one shard) is not supported with quantization")
        super().__init__(inner)
        self.all, self.fmt = dict(targets), fmt
        self.dtype, self.device = dtype, device
        self.direct: frozenset[str] = frozenset()  # targets whose e4m3 words and scales are received
        self._wide: dict[str, torch.Tensor] = {}
        # inner mapping id -> (that mapping, kept so its id stays its own; the joined view)
        self._joined: dict[int, tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._arrange(frozenset())

    def _arrange(self, direct: frozenset[str]) -> None:
        """Targets in ``direct`` are received quantized; a wide copy is kept of the others."""
        self.direct = direct
        self.targets = {n: t for n, t in self.all.items() if n not in direct}
        self._scales = {t.scale for t in self.targets.values()}  # hidden: derived here
        self._wide = {n: t for n, t in self._wide.items() if n in self.targets}
        self._joined.clear()

    def _copy(self, name: str) -> torch.Tensor:
        """``name``'s model-dtype copy (zeros until a receive writes it)."""
        hit = self._wide.get(name)
        if hit is None:
            hit = self._wide[name] = torch.zeros(self.targets[name].shape, dtype=self.dtype, device=self.device)
        return hit

    def bind(self, rank: RankLayout) -> None:
        self._arrange(frozenset(t.name for t in rank.tensors if t.name in self.all and t.dtype == WORD))
        self.inner.bind(rank)

    def _view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self.direct:
            return t.view(torch.int32)
        return self._copy(name) if name in self.targets else t

    def _join(self, inner: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inner`` with the wide copies in place of the FP8 weights and without the scales:
        the engine layout the paths write; one dict per inner mapping (the served one and two
        staging sets), made once."""
        hit = self._joined.get(id(inner))
        if hit is None or hit[0] is not inner:
            if len(self._joined) >= 3:  # served and two staging sets
                self._joined.pop(next(iter(self._joined)))
            hit = (inner, {n: self._view(n, t) for n, t in inner.items() if n not in self._scales})
            self._joined[id(inner)] = hit
        return hit[1]

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._join(self.inner.tensors())

    def served(self) -> Mapping[str, torch.Tensor]:
        return {n: self._view(n, t) for n, t in self.inner.served().items() if n not in self._scales}

    @torch.no_grad()
    def received(self) -> int:
        """Quantize every received shard into the inner destination; counts the e4m3 bytes and
        scales that differ from the served ones (what a delta of the FP8 weights would move)."""
        into, served = self.inner.tensors(), self.inner.served()
        changed = 0
        for name, target in self.targets.items():
            q, s = quantize(self._copy(name), self.fmt)
            changed += int((served[name].view(torch.uint8) != q.view(torch.uint8)).sum())
            changed += int((served[target.scale] != s).sum())
            into[name].copy_(q)
            into[target.scale].copy_(s)
        return changed + self.inner.received()

    def pushed(self, staging: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A staging set as the paths write it: the e4m3 weights sent quantized as words, the
        others into their model-dtype copies (quantized into the set by ``received``)."""
        return self._join(staging)

    def unpushable(self) -> str | None:
        return self.inner.unpushable()

    @torch.no_grad()
    def stale(self) -> set[str]:
        served = self.inner.served()
        out = set()
        for name, target in self.targets.items():
            q, s = quantize(self._copy(name), self.fmt)
            if not (torch.equal(served[name].view(torch.uint8), q.view(torch.uint8))
                    and torch.equal(served[target.scale], s)):
                out.add(name)
        return out
