"""FP8 on the wire: an FP8 engine's plans carry each quantized weight as its e4m3 bytes and its
block scales, quantized by the trainer rank that holds the blocks.

A logical weight whose every 128 x 128 block lies within one trainer rank's region of it and
within one engine piece is *sent quantized*: in every layout of the topology it becomes two
logical tensors, itself as e4m3 bytes (four to an int32 word, so the wire moves them bit for bit
as ``raw`` words) and ``name + scale_suffix``, its float32 scales (the names of an FP8
checkpoint).  Trainer ranks quantize their region (``Derived``) before a send; engines receive
into their FP8 tensors and scales in place.  Because a block never spans two pieces, each side's
quantization of its region is the slice of the engine quantizer's result on the full tensor.

A weight some of whose blocks straddle trainer shards (a TP that cuts heads of 64, an FSDP2
row split) is cut into ``Cell``s at the block boundaries around each trainer boundary: each
cell is a logical tensor of its own (``name[r0:r1,c0:c1]``), sent quantized where no trainer
boundary crosses it, and in the model dtype where one does (only those blocks move wide).  Each
box of an engine tensor that moves wide lands in a model-dtype twin of the box's size
(``twin``), and the engine quantizes just those blocks on receipt (``receiver.quantized``).
A weight with no whole cell moves wide, and the engine quantizes its whole tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shardsync.layout.base import Layout
from shardsync.piece import Box, Piece, RankLayout, Role, TensorMeta, box_overlap, volume
from shardsync.plan.plan import Rider
from shardsync.quant.fp8 import Fp8Format

WORD = "int32"  # e4m3 bytes travel as words of four: any wire dtype of 2 or 4 bytes moves them whole
PER_WORD = 4
SCALE = "float32"
DERIVED = "fp8:"  # a trainer's quantized region of a logical weight is its local tensor DERIVED + name
WIDE = "@wide"  # a box of an engine tensor that moves wide lands in its model-dtype twin: ``twin``


def twin(local: str, offsets: Box, sizes: Box) -> str:
    """The name of the model-dtype twin of the box ``offsets/sizes`` of engine tensor ``local``
    (received quantized but for that box): ``local@wide[r0:r1,c0:c1]``, for people; what it
    stands for is its ``TensorMeta``'s ``parent`` and ``at``."""
    return f"{local}{WIDE}[{','.join(f'{o}:{o + n}' for o, n in zip(offsets, sizes, strict=True))}]"


def wide_copies(rank: RankLayout) -> int:
    """Elements of the model-dtype copies an FP8 engine rank keeps beside what it serves (a
    retyped layout's): its FP8 tensors received wide whole, and the twins of boxes received wide."""
    return sum(t.numel for t in rank.tensors if (t.fp8 and t.role is Role.VALUES) or t.role is Role.TWIN)


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
class Cell:
    """A box of a weight cut at the blocks around trainer boundaries, moved as its own logical
    tensor ``name``: quantized (no trainer boundary crosses it) or in the model dtype."""

    name: str
    offsets: Box
    sizes: Box
    quantized: bool


def _cut(p: Piece, cell: Cell) -> Piece | None:
    """The part of ``p`` (a piece of the weight) inside ``cell``, still in the weight's coordinates."""
    ov = box_overlap(p.offsets, p.sizes, cell.offsets, cell.sizes)
    if ov is None:
        return None
    lo, sizes = ov
    return Piece(p.logical, lo, sizes, p.local, tuple(lo_ + x - o for lo_, x, o in zip(p.local_offsets, lo, p.offsets,
                                                                                       strict=True)))


def _in_cell(p: Piece, cell: Cell) -> Piece:
    """A piece inside ``cell`` as a piece of the cell's logical tensor."""
    return Piece(cell.name, tuple(o - c for o, c in zip(p.offsets, cell.offsets, strict=True)), p.sizes, p.local,
                 p.local_offsets)


def cells(name: str, shape: Box, regions: Iterable[tuple[Box, Box]], fmt: Fp8Format) -> tuple[Cell, ...]:
    """``name`` cut at the block boundaries around every trainer region's edges: a cell that an
    edge crosses straddles two ranks' shards (wide); the others lie in one rank's (quantized,
    when they are whole words too)."""
    edges = [sorted({x for off, size in regions for x in (off[d], off[d] + size[d])}) for d in (0, 1)]
    axes = []
    for d, b in enumerate(fmt.blocks(shape)):
        n = shape[d]
        cuts = sorted({0, n} | {c for x in edges[d] for c in (x // b * b, min(-(-x // b) * b, n))})
        axes.append([(lo, hi, any(lo < x < hi for x in edges[d])) for lo, hi in zip(cuts, cuts[1:], strict=False)])
    out = []
    for r0, r1, rows_cut in axes[0]:
        for c0, c1, cols_cut in axes[1]:
            offsets, sizes = (r0, c0), (r1 - r0, c1 - c0)
            whole = not (rows_cut or cols_cut) and _aligned(offsets, sizes, shape, fmt)
            out.append(Cell(f"{name}[{r0}:{r1},{c0}:{c1}]", offsets, sizes, whole))
    return tuple(out)


@dataclass(frozen=True)
class Derived:
    """One trainer rank's region of a weight sent quantized: ``parts`` (its pieces of the weight,
    in the weight's coordinates, as are ``offsets``) are assembled into the region, which is
    quantized into local tensors ``words`` and ``scales``: the box at ``at`` of wire tensor
    ``logical`` (the weight, or one of its cells)."""

    logical: str
    offsets: Box
    sizes: Box
    parts: tuple[Piece, ...]
    words: str
    scales: str
    at: Box = (0, 0)


@dataclass(frozen=True)
class Fp8Wire:
    """The weights ``sent`` quantized whole in ``fmt``, those ``split`` into cells, and how each
    layout holds them."""

    fmt: Fp8Format
    sent: frozenset[str]
    split: dict[str, tuple[Cell, ...]] = field(default_factory=dict)

    def scale(self, name: str) -> str:
        return name + self.fmt.scale_suffix

    @property
    def quantized(self) -> frozenset[str]:
        """The wire's logical tensors of e4m3 words: the weights sent whole and the whole cells."""
        return self.sent | {c.name for cs in self.split.values() for c in cs if c.quantized}

    def summary(self, engines: Sequence[Layout], itemsize: int) -> str:
        """One line on what the wire carries quantized and what the busiest engine rank keeps in
        the model dtype (``engines``: the retyped engine layouts; ``itemsize``: the model dtype's)."""
        cut = f", {len(self.split)} more in part (the blocks trainer shards cut move wide)" if self.split else ""
        copies = max(wide_copies(r) for lay in engines for r in lay.ranks) * itemsize
        return (f"FP8 on the wire: {len(self.sent)} weights sent as e4m3 bytes and scales (quantized by the trainer)"
                f"{cut}; the engines quantize the rest of their {self.fmt.name} tensors, keeping {copies / 2**20:.2f} "
                "MiB of model-dtype copies of what arrives wide (busiest engine rank)")

    def riders(self, logical: dict[str, Box]) -> dict[str, Rider]:
        """Each wire tensor of e4m3 words -> its scales and the words one scale covers (``logical``:
        the wire's shapes): plans take a block's scale from its words' holder and buckets carry
        them together."""
        out = {}
        for n in sorted(self.quantized):
            rows, cols = self.fmt.block or (1, logical[n][1] * PER_WORD)  # per channel: a whole row
            out[n] = Rider(self.scale(n), rows, cols // PER_WORD)
        return out

    @property
    def raw(self) -> dict[str, str]:
        """Logical tensors moving as their own bits: the e4m3 words and the float32 scales."""
        return {k: v for n in sorted(self.quantized) for k, v in ((n, WORD), (self.scale(n), SCALE))}

    def logical(self, logical: dict[str, Box]) -> dict[str, Box]:
        out: dict[str, Box] = {}
        for name, shape in logical.items():
            if name in self.sent:
                out[name] = (shape[0], shape[1] // PER_WORD)
                out[self.scale(name)] = self.fmt.scale_shape(shape)
            elif name in self.split:
                for c in self.split[name]:
                    if c.quantized:
                        out[c.name] = (c.sizes[0], c.sizes[1] // PER_WORD)
                        out[self.scale(c.name)] = self.fmt.scale_shape(c.sizes)
                    else:
                        out[c.name] = c.sizes
            else:
                out[name] = shape
        return out

    def _parts(self, p: Piece) -> list[tuple[bool, Piece]]:
        """``p`` as the wire carries it: (quantized?, piece of a wire logical tensor) per cell."""
        if p.logical in self.split:
            return [(c.quantized, _in_cell(q, c)) for c in self.split[p.logical] if (q := _cut(p, c)) is not None]
        return [(p.logical in self.sent, p)]

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
        each tensor holding some holds their e4m3 words, its scale tensor (``name + scale_suffix``)
        their scales, and each box of it that moves wide its own twin (``twin``: a model-dtype
        tensor of the box's size).  Ranks that shared tuples still do."""
        done: dict[tuple[int, int], RankLayout] = {}
        metas: dict[TensorMeta, tuple[TensorMeta, TensorMeta]] = {}  # TP ranks hold equal tensors: made once
        ranks = []
        for rank in layout.ranks:
            key = (id(rank.tensors), id(rank.pieces))
            if key not in done:
                done[key] = self._retype_rank(rank, metas)
            ranks.append(RankLayout(rank.label, done[key].tensors, done[key].pieces))
        return Layout(layout.kind, layout.spec, self.logical(layout.logical), tuple(ranks), layout.params)

    def _quantized_metas(self, t: TensorMeta) -> tuple[TensorMeta, TensorMeta]:
        """Engine tensor ``t`` held as e4m3 words, and its scale tensor."""
        held = t.held
        words = (t.shape[0], t.shape[1] // PER_WORD)
        held_words = None if held is None else (*held[:-1], held[-1] // PER_WORD)
        grid = self.fmt.scale_shape(t.stored)
        return (TensorMeta(t.name, words, WORD, held_words, role=Role.WORDS),
                TensorMeta(self.scale(t.name), (math.prod(grid[:-1]), grid[-1]), SCALE, None if held is None else grid,
                           role=Role.SCALES, parent=t.name))

    def _retype_rank(self, rank: RankLayout, metas: dict[TensorMeta, tuple[TensorMeta, TensorMeta]]) -> RankLayout:
        sent, split = self.sent, self.split
        cuts = {i: self._parts(p) for i, p in enumerate(rank.pieces) if p.logical in split}  # the rare cells
        words_in: set[str] = set()
        wide: dict[str, list[Piece]] = {}  # a local tensor's pieces (or cut parts) that move wide
        for i, p in enumerate(rank.pieces):
            for quantized, q in cuts.get(i) or [(p.logical in sent, p)]:
                if quantized:
                    words_in.add(p.local)
                else:
                    wide.setdefault(p.local, []).append(q)
        tensors: list[TensorMeta] = []
        for t in rank.tensors:
            if t.name not in words_in:
                tensors.append(t)
                continue
            made = metas.get(t)
            if made is None:
                made = metas[t] = self._quantized_metas(t)
            tensors += made
            tensors += [TensorMeta(twin(t.name, q.local_offsets, q.sizes), q.sizes, t.dtype, role=Role.TWIN,
                                   parent=t.name, at=q.local_offsets)
                        for q in wide.get(t.name, ())]
        pieces: list[Piece] = []
        for i, p in enumerate(rank.pieces):
            for quantized, q in cuts.get(i) or [(p.logical in sent, p)]:
                if p.local not in words_in:  # a model-dtype tensor: its pieces, cut or not
                    pieces.append(q)
                elif quantized:
                    pieces += [self._words(q, q.local, q.local_offsets),
                               self._scale_piece(q, self.scale(q.local), q.local_offsets)]
                else:  # into its twin, which is just this box
                    pieces.append(Piece(q.logical, q.offsets, q.sizes, twin(q.local, q.local_offsets, q.sizes),
                                        (0,) * len(q.sizes)))
        return RankLayout(rank.label, tuple(tensors), tuple(pieces))

    def trainer(self, layout: Layout) -> tuple[Layout, tuple[tuple[Derived, ...], ...]]:
        """The trainer layout with each rank's region of every weight sent quantized (and each
        whole cell) held in two derived local tensors (``Derived``), and per rank what derives them."""
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

    def _derive(self, name: str, offsets: Box, sizes: Box, parts: Sequence[Piece], at: Box,
                tensors: list[TensorMeta], pieces: list[Piece]) -> Derived:
        d = Derived(name, offsets, sizes, tuple(parts), DERIVED + name, DERIVED + self.scale(name), at)
        region = Piece(name, at, sizes, d.words, (0, 0))
        words, scale = self._words(region, d.words, (0, 0)), self._scale_piece(region, d.scales, (0, 0))
        tensors += [TensorMeta(d.words, words.sizes, WORD, role=Role.WORDS, parent=name),
                    TensorMeta(d.scales, scale.sizes, SCALE, role=Role.SCALES, parent=d.words)]
        pieces += [words, scale]
        return d

    def _trainer_rank(self, rank: RankLayout) -> tuple[RankLayout, tuple[Derived, ...]]:
        mine = _by_logical(p for p in rank.pieces if p.logical in self.sent or p.logical in self.split)
        tensors = list(rank.tensors)
        pieces = [p for p in rank.pieces if p.logical not in mine]
        recipes = []
        for name, parts in mine.items():
            box = _bounds(parts)
            if box is None:
                raise ValueError(f"{rank.label}: its pieces of {name} leave holes; it cannot be sent quantized")
            if name in self.sent:
                recipes.append(self._derive(name, *box, parts, box[0], tensors, pieces))
                continue
            for c in self.split[name]:
                cut = [q for p in parts if (q := _cut(p, c)) is not None]
                if not cut:
                    continue
                if c.quantized:  # no trainer edge crosses it: it lies in this rank's region whole
                    recipes.append(self._derive(c.name, c.offsets, c.sizes, cut, (0, 0), tensors, pieces))
                else:
                    pieces += [_in_cell(q, c) for q in cut]
        return RankLayout(rank.label, tuple(tensors), tuple(pieces)), tuple(recipes)


def fp8_wire(trainer: Layout, engines: Sequence[Layout], fmt: Fp8Format) -> Fp8Wire:
    """How ``trainer`` sends the weights of the engine tensors their rows hold in FP8
    (``TensorMeta.fp8``) to ``engines``: whole (every block in one trainer region), cut into
    cells (some straddle trainer regions), or wide (the engine's pieces are not whole blocks, a
    trainer rank's pieces leave holes, or no cell is whole); see the module."""
    logical = trainer.logical
    candidates: set[str] = set()
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
                candidates.update(p.logical for p in held)
                bad.update(p.logical for p in held
                           if not (_aligned(p.offsets, p.sizes, logical[p.logical], fmt)
                                   and _aligned(p.local_offsets, p.sizes, t.shape, fmt)))
    regions: dict[str, set[tuple[Box, Box]]] = {}
    cut: set[str] = set()  # weights some trainer region of which is not whole blocks
    for rank in {id(r.pieces): r for r in trainer.ranks}.values():  # DP replicas share tuples
        for name, parts in _by_logical(p for p in rank.pieces if p.logical in candidates).items():
            box = _bounds(parts)
            if box is None or len(box[0]) != 2:
                bad.add(name)
                continue
            regions.setdefault(name, set()).add(box)
            if not _aligned(*box, logical[name], fmt):
                cut.add(name)
    sent, split = set(candidates - bad - cut), {}
    for name in sorted(cut - bad):
        grid = cells(name, logical[name], regions[name], fmt)
        if all(c.quantized for c in grid):
            sent.add(name)
        elif any(c.quantized for c in grid):
            split[name] = grid
    return Fp8Wire(fmt, frozenset(sent), split)
