"""FP8 on the wire: an FP8 engine's plans carry each quantized weight as its e4m3 bytes and its
block scales, quantized by the trainer rank that holds the blocks.

A logical weight whose every 128 x 128 block lies within one trainer rank's region of it and
within one engine piece is *sent quantized*: in every layout of the topology it becomes two
logical tensors, itself as e4m3 bytes (four to an int32 word, so the wire moves them bit for bit
as ``raw`` words) and ``name + scale_suffix``, its float32 scales (the names of an FP8
checkpoint).  Trainer ranks quantize their region (``Derived``) before a send; engines receive
into their FP8 tensors and scales in place.  Because a block never spans two pieces, each side's
quantization of its region is the slice of the engine quantizer's result on the full tensor.
The other weights (blocks that straddle trainer shards) move in the model dtype and the engine
quantizes them on receipt (``receiver.quantized``).  An engine tensor is sent quantized whole
or not at all: its weights decide together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shardsync.layout.piece import Box, Layout, Piece, RankLayout, TensorMeta, volume
from shardsync.quant.fp8 import Fp8Format

WORD = "int32"  # e4m3 bytes travel as words of four: any wire dtype of 2 or 4 bytes moves them whole
PER_WORD = 4
SCALE = "float32"
DERIVED = "fp8:"  # a trainer's quantized region of a logical weight is its local tensor DERIVED + name


def _aligned(offsets: Box, sizes: Box, shape: Box, fmt: Fp8Format) -> bool:
    """Whether a box of a ``shape`` matrix is whole blocks and whole words."""
    return fmt.whole_blocks(offsets, sizes, shape) and offsets[1] % PER_WORD == 0 and sizes[1] % PER_WORD == 0


def _bounds(pieces: Sequence[Piece]) -> tuple[Box, Box] | None:
    """The box a rank's pieces of one logical tensor tile exactly (None: they leave holes)."""
    lo = tuple(min(p.offsets[d] for p in pieces) for d in range(len(pieces[0].offsets)))
    hi = tuple(max(p.offsets[d] + p.sizes[d] for p in pieces) for d in range(len(pieces[0].offsets)))
    sizes = tuple(h - low for h, low in zip(hi, lo, strict=True))
    return (lo, sizes) if sum(p.numel for p in pieces) == volume(sizes) else None


def _by_logical(pieces: Iterable[Piece]) -> dict[str, list[Piece]]:
    out: dict[str, list[Piece]] = {}
    for p in pieces:
        out.setdefault(p.logical, []).append(p)
    return out


@dataclass(frozen=True)
class Derived:
    """One trainer rank's region of a weight sent quantized: ``parts`` (its pieces of it) are
    assembled into the region, which is quantized into local tensors ``words`` and ``scales``."""

    logical: str
    offsets: Box
    sizes: Box
    parts: tuple[Piece, ...]
    words: str
    scales: str


@dataclass(frozen=True)
class Fp8Wire:
    """The weights ``sent`` quantized in ``fmt`` and how each layout holds them."""

    fmt: Fp8Format
    sent: frozenset[str]

    def scale(self, name: str) -> str:
        return name + self.fmt.scale_suffix

    @property
    def raw(self) -> dict[str, str]:
        """Logical tensors moving as their own bits: the e4m3 words and the float32 scales."""
        return {k: v for n in sorted(self.sent) for k, v in ((n, WORD), (self.scale(n), SCALE))}

    def logical(self, logical: dict[str, Box]) -> dict[str, Box]:
        out: dict[str, Box] = {}
        for name, shape in logical.items():
            if name in self.sent:
                out[name] = (shape[0], shape[1] // PER_WORD)
                out[self.scale(name)] = self.fmt.scale_shape(shape)
            else:
                out[name] = shape
        return out

    def _scale_piece(self, p: Piece, local: str, local_offsets: Box) -> Piece:
        bm, bn = self.fmt.block or (1, p.sizes[1])  # per channel: a whole row is one block
        return Piece(self.scale(p.logical), (p.offsets[0] // bm, p.offsets[1] // bn),
                     (math.ceil(p.sizes[0] / bm), math.ceil(p.sizes[1] / bn)), local,
                     (local_offsets[0] // bm, local_offsets[1] // bn))

    @staticmethod
    def _words(p: Piece, local: str, local_offsets: Box) -> Piece:
        return Piece(p.logical, (p.offsets[0], p.offsets[1] // PER_WORD), (p.sizes[0], p.sizes[1] // PER_WORD),
                     local, (local_offsets[0], local_offsets[1] // PER_WORD))

    def retype(self, layout: Layout) -> Layout:
        """A layout whose tensors hold weights sent quantized in place (an engine's, whole tensors):
        each such tensor holds their e4m3 words, and its scale tensor (``name + scale_suffix``)
        their scales.  Ranks that shared tuples still do."""
        done: dict[tuple[int, int], RankLayout] = {}
        ranks = []
        for rank in layout.ranks:
            key = (id(rank.tensors), id(rank.pieces))
            if key not in done:
                done[key] = self._retype_rank(rank)
            ranks.append(RankLayout(rank.label, done[key].tensors, done[key].pieces))
        return Layout(layout.kind, layout.spec, self.logical(layout.logical), tuple(ranks), layout.params)

    def _retype_rank(self, rank: RankLayout) -> RankLayout:
        locals_ = {p.local for p in rank.pieces if p.logical in self.sent}
        tensors: list[TensorMeta] = []
        for t in rank.tensors:
            if t.name not in locals_:
                tensors.append(t)
                continue
            held = t.held
            words = (t.shape[0], t.shape[1] // PER_WORD)
            held_words = None if held is None else (*held[:-1], held[-1] // PER_WORD)
            tensors.append(TensorMeta(t.name, words, WORD, held_words))
            grid = self.fmt.scale_shape(t.stored)
            tensors.append(TensorMeta(self.scale(t.name), (math.prod(grid[:-1]), grid[-1]), SCALE,
                                      None if held is None else grid))
        pieces: list[Piece] = []
        for p in rank.pieces:
            if p.local not in locals_:
                pieces.append(p)
            elif p.logical not in self.sent:
                raise ValueError(f"{rank.label}: {p.local} holds {p.logical}, which is not sent quantized, beside "
                                 "weights that are: an engine tensor is sent quantized whole or not at all")
            else:
                pieces.append(self._words(p, p.local, p.local_offsets))
                pieces.append(self._scale_piece(p, self.scale(p.local), p.local_offsets))
        return RankLayout(rank.label, tuple(tensors), tuple(pieces))

    def trainer(self, layout: Layout) -> tuple[Layout, tuple[tuple[Derived, ...], ...]]:
        """The trainer layout with each rank's region of every weight sent quantized held in
        two derived local tensors (``Derived``), and per rank what derives them."""
        done: dict[tuple[int, int], tuple[RankLayout, tuple[Derived, ...]]] = {}
        ranks, derived = [], []
        for rank in layout.ranks:
            key = (id(rank.tensors), id(rank.pieces))
            if key not in done:
                done[key] = self._trainer_rank(rank)
            made, recipes = done[key]
            ranks.append(RankLayout(rank.label, made.tensors, made.pieces))
            derived.append(recipes)
        return (Layout(layout.kind, layout.spec, self.logical(layout.logical), tuple(ranks), layout.params),
                tuple(derived))

    def _trainer_rank(self, rank: RankLayout) -> tuple[RankLayout, tuple[Derived, ...]]:
        mine = _by_logical(p for p in rank.pieces if p.logical in self.sent)
        tensors = list(rank.tensors)
        pieces = [p for p in rank.pieces if p.logical not in self.sent]
        recipes = []
        for name, parts in mine.items():
            box = _bounds(parts)
            if box is None:
                raise ValueError(f"{rank.label}: its pieces of {name} leave holes; it cannot be sent quantized")
            offsets, sizes = box
            d = Derived(name, offsets, sizes, tuple(parts), DERIVED + name, DERIVED + self.scale(name))
            region = Piece(name, offsets, sizes, d.words, (0, 0))
            words, scale = self._words(region, d.words, (0, 0)), self._scale_piece(region, d.scales, (0, 0))
            tensors += [TensorMeta(d.words, words.sizes, WORD), TensorMeta(d.scales, scale.sizes, SCALE)]
            pieces += [words, scale]
            recipes.append(d)
        return RankLayout(rank.label, tuple(tensors), tuple(pieces)), tuple(recipes)


def fp8_wire(trainer: Layout, engines: Sequence[Layout], fmt: Fp8Format) -> Fp8Wire:
    """Which weights can be sent quantized from ``trainer`` to ``engines`` (every engine tensor
    its rows hold in FP8 (``TensorMeta.fp8``) whose weights are whole blocks on both sides; see the module)."""
    logical = trainer.logical
    groups: list[frozenset[str]] = []
    bad: set[str] = set()
    for lay in engines:
        for rank in {id(r.pieces): r for r in lay.ranks}.values():  # identical engines share tuples
            by_local: dict[str, list[Piece]] = {}
            for p in rank.pieces:
                by_local.setdefault(p.local, []).append(p)
            for t in rank.tensors:
                if not t.fp8 or t.name not in by_local:
                    continue
                held = by_local[t.name]
                groups.append(frozenset(p.logical for p in held))
                bad.update(p.logical for p in held
                           if not (_aligned(p.offsets, p.sizes, logical[p.logical], fmt)
                                   and _aligned(p.local_offsets, p.sizes, t.shape, fmt)))
    candidates = frozenset().union(*groups)
    for rank in trainer.ranks:
        for name, parts in _by_logical(p for p in rank.pieces if p.logical in candidates).items():
            box = _bounds(parts)
            if box is None or not _aligned(*box, logical[name], fmt):
                bad.add(name)
    while True:  # an engine tensor goes quantized whole: one wide weight makes its neighbours wide
        more = {n for g in groups if g & bad for n in g} - bad
        if not more:
            break
        bad |= more
    return Fp8Wire(fmt, candidates - bad)
