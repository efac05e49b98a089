"""An FP8 engine's receive.  Weights the plans carry quantized (``quant.wire``: their blocks lie
in one trainer shard) land as e4m3 words and scales straight in the served tensors (or their
staging).  The others land in a model-dtype copy, and the rank quantizes its own shard
(``quant.fp8``) into what it serves: a whole tensor, or (a tensor some of whose blocks straddle
trainer shards) just the blocks that arrived wide.

The copy is the engine's shard of the trainer's weights, kept across updates (a delta
applies to it); ``received`` quantizes it right after a receive, off the engine's pause,
into the wrapped destination (the live FP8 weights in place, or their staging copy that
the wrapped ``commit`` swaps in).  Every quantized block lies within one piece
(``quant.targets``), so the result equals the engine's quantizer on the full tensor.
Checksums read the copy (what was received); ``stale`` names weights whose served FP8
bytes or scales are not the quantization of it (a stale scale is caught there).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from shardsync.piece import Box, RankLayout, Role
from shardsync.plan.runs import box_view
from shardsync.quant.fp8 import Fp8Format, quantize
from shardsync.quant.targets import Target
from shardsync.receiver.destination import Deriving, Destination


class Quantized(Deriving):
    """``inner`` holds the engine's served tensors (FP8 weights, their scales, the rest);
    ``targets`` the quantized ones (``quant.quantized``).  Memory: a model-dtype copy of each
    quantized tensor that arrives wide, and of each box that arrives wide in one received
    quantized (its twin, ``quant.wire.twin``), made when first addressed (a connection ``bind``s
    first: the tensors it carries quantized whole need none).  ``stale`` names the local tensors
    whose pieces a stale block would misstate (a target, or a twin)."""

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
        # direct targets' boxes that arrive wide: (their twin, offsets, sizes)
        self.mixed: dict[str, tuple[tuple[str, Box, Box], ...]] = {}
        self._twins: dict[str, Box] = {}  # twin -> its shape
        self._wide: dict[str, torch.Tensor] = {}
        # inner mapping id -> (that mapping, kept so its id stays its own; the joined view)
        self._joined: dict[int, tuple[Mapping[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._arrange(frozenset(), {})

    def _arrange(self, direct: frozenset[str], mixed: dict[str, tuple[tuple[str, Box, Box], ...]]) -> None:
        """Targets in ``direct`` are received quantized but for their ``mixed`` boxes; a wide copy
        is kept of the others and of each of those boxes."""
        self.direct, self.mixed = direct, mixed
        self._twins = {tw: sizes for boxes in mixed.values() for tw, _, sizes in boxes}
        self.targets = {n: t for n, t in self.all.items() if n not in direct}
        self._scales = {t.scale for t in self.targets.values()}  # hidden: derived here
        self._wide = {n: t for n, t in self._wide.items() if n in self.targets or n in self._twins}
        self._joined.clear()

    def _copy(self, name: str) -> torch.Tensor:
        """``name``'s model-dtype copy, a target's or a twin's (zeros until a receive writes it)."""
        hit = self._wide.get(name)
        if hit is None:
            shape = self._twins[name] if name in self._twins else self.all[name].shape
            hit = self._wide[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return hit

    def bind(self, rank: RankLayout) -> None:
        direct = frozenset(t.name for t in rank.tensors if t.name in self.all and t.role is Role.WORDS)
        boxes: dict[str, list[tuple[str, Box, Box]]] = {}
        for t in rank.tensors:
            if t.role is Role.TWIN and t.parent is not None and t.parent in direct and t.at is not None:
                boxes.setdefault(t.parent, []).append((t.name, t.at, t.shape))
        self._arrange(direct, {n: tuple(b) for n, b in boxes.items()})
        self.inner.bind(rank)

    def _view(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name in self.direct:
            return t.view(torch.int32)
        return self._copy(name) if name in self.targets else t

    def _with_twins(self, inner: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {n: self._view(n, t) for n, t in inner.items() if n not in self._scales}
        out.update({tw: self._copy(tw) for n, boxes in self.mixed.items() if n in inner for tw, _, _ in boxes})
        return out

    def _join(self, inner: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``inner`` with the wide copies in place of the FP8 weights (or beside them, as their
        twins), without the scales derived here: the engine layout the paths write; one dict
        per inner mapping (the served one and two staging sets), made once."""
        hit = self._joined.get(id(inner))
        if hit is None or hit[0] is not inner:
            if len(self._joined) >= 3:  # served and two staging sets
                self._joined.pop(next(iter(self._joined)))
            hit = (inner, self._with_twins(inner))
            self._joined[id(inner)] = hit
        return hit[1]

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._join(self.inner.tensors())

    def served(self) -> Mapping[str, torch.Tensor]:
        return self._with_twins(self.inner.served())

    def _boxes(self, held: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor,
                                                                         torch.Tensor]]:
        """What this rank quantizes, box by box: the local tensor its pieces arrive in (a target,
        or a twin), its e4m3 and scale boxes in ``held`` (the served tensors or a staging set),
        and the model-dtype copy they quantize."""
        for name, target in self.targets.items():
            yield name, held[name], held[target.scale], self._copy(name)
        for name, boxes in self.mixed.items():
            target = self.all[name]
            cols = target.shape[-1]
            fp8 = held[name].view(-1, cols)
            scales = held[target.scale].view(-1, target.scale_shape[-1])
            bm, bn = self.fmt.blocks(tuple(target.shape))
            for tw, offsets, sizes in boxes:
                grid = (offsets[0] // bm, offsets[1] // bn), (-(-sizes[0] // bm), -(-sizes[1] // bn))
                yield tw, box_view(fp8, offsets, sizes), box_view(scales, *grid), self._copy(tw)

    @torch.no_grad()
    def received(self) -> int:
        """Quantize every shard (or box of one) received wide into the inner destination; counts
        the e4m3 bytes and scales that differ from the served ones (what a delta of the FP8
        weights would move)."""
        changed = 0
        for (_, served_q, served_s, wide), (_, into_q, into_s, _) in zip(
                self._boxes(self.inner.served()), self._boxes(self.inner.tensors()), strict=True):
            q, s = quantize(wide, self.fmt)
            changed += int((served_q.view(torch.uint8) != q.view(torch.uint8)).sum())
            changed += int((served_s != s).sum())
            into_q.copy_(q)
            into_s.copy_(s)
        return changed + self.inner.received()

    def pushed(self, staging: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """A staging set as the paths write it: the e4m3 weights sent quantized as words, the
        others into their model-dtype copies (quantized into the set by ``received``)."""
        return self._join(staging)

    def unpushable(self) -> str | None:
        return self.inner.unpushable()

    @torch.no_grad()
    def stale(self) -> set[str]:
        out = set()
        for name, served_q, served_s, wide in self._boxes(self.inner.served()):
            q, s = quantize(wide, self.fmt)
            if not (torch.equal(served_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(served_s, s)):
                out.add(name)
        return out
