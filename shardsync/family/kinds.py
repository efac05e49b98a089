"""The sharding kinds families share, each with its cut rule: held whole, split over TP, fused
parts, concatenated wholes, the two fused-QKV orders (Megatron's per query group, the engines'
per rank) and the two expert forms (Megatron's per-expert MLPs, the engines' FusedMoE stacks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shardsync.family.cut import Cut, Kind, Local
from shardsync.family.table import dims
from shardsync.piece import Piece, Segment, stacked, whole

if TYPE_CHECKING:
    from shardsync.spec import ModelSpec


@dataclass(frozen=True)
class Part:
    """Block ``index`` of ``count`` equal row blocks of a logical tensor (a fused checkpoint
    tensor's gate half is ``Part("mlp.gate_up_proj.weight", 0, 2)``)."""

    name: str
    index: int = 0
    count: int = 1

    def segments(self, c: Cut) -> list[Segment]:
        """This rank's share of the block's rows."""
        name = c.hf + self.name
        rows = c.logical[name][0] // self.count
        n = rows // c.tp
        return [Segment(name, self.index * rows + c.rank * n, n)]


@dataclass(frozen=True)
class Rows:
    """Row blocks of a logical tensor, in ``dims`` symbols (or digits): ``size`` rows at ``start``;
    with ``groups``, that many such blocks, block g at ``start + g * stride``.  Split over TP, a
    rank takes its share of the one block's rows, or its share of the groups (each whole): the
    conv channels ``[q | k | v]`` of its heads, or Megatron's per-group parts of an interleaved
    checkpoint projection."""

    name: str
    size: str
    start: str = "0"
    groups: str | None = None
    stride: str | None = None

    def segments(self, c: Cut) -> list[Segment]:
        """This rank's share of the block's rows, or of its groups."""
        name, sym = c.hf + self.name, dims(c.spec)

        def num(s: str) -> int:
            return int(s) if s.isdigit() else sym[s]

        start, size = num(self.start), num(self.size)
        if self.groups is None:
            n = size // c.tp
            return [Segment(name, start + c.rank * n, n)]
        groups, stride = num(self.groups), num(self.stride or self.size)
        mine = groups // c.tp
        return [Segment(name, start + g * stride, size) for g in range(c.rank * mine, (c.rank + 1) * mine)]


@dataclass(frozen=True)
class Whole(Kind):
    """Held whole on every rank (norms, routers, MLA's down projections)."""

    source: str | None = None  # None: the row's own name

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        src = c.hf + (self.source or row)
        return [Local(name, c.logical[src], [whole(name, src, c.logical)])]


@dataclass(frozen=True)
class Split(Kind):
    """Split evenly over the tensor-parallel ranks along ``dim`` (0: column-parallel,
    1: row-parallel in Megatron's words)."""

    source: str | None = None
    dim: int = 0

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        src = c.hf + (self.source or row)
        shape = list(c.logical[src])
        n = shape[self.dim] // c.tp
        shape[self.dim] = n
        return [Local(name, tuple(shape), stacked(name, [Segment(src, c.rank * n, n)], c.logical, self.dim))]


@dataclass(frozen=True)
class Fused(Kind):
    """Each part split over the tensor-parallel ranks, the rank's slices stacked along dim 0
    (``gate_up_proj``, Megatron's ``linear_fc1``; parts of unequal rows: ``Rows``)."""

    parts: tuple[Part | Rows, ...]

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        segs = [seg for p in self.parts for seg in p.segments(c)]
        cols = c.logical[segs[0].logical][1:]
        return [Local(name, (sum(s.length for s in segs), *cols), stacked(name, segs, c.logical, 0))]


@dataclass(frozen=True)
class Concat(Kind):
    """Whole logical tensors stacked along dim 0, held whole on every rank (SGLang's
    ``fused_qkv_a_proj_with_mqa`` = [q_a_proj; kv_a_proj_with_mqa])."""

    sources: tuple[str, ...]

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        srcs = [c.hf + s for s in self.sources]
        segs = [Segment(s, 0, c.logical[s][0]) for s in srcs]
        cols = c.logical[srcs[0]][1:]
        return [Local(name, (sum(s.length for s in segs), *cols), stacked(name, segs, c.logical, 0))]


def qkv_segments(spec: ModelSpec, hf: str, suffix: str, gate: bool = False) -> list[Segment]:
    """Global fused QKV rows: per query group, its q heads, then its k head, then its v head.
    ``gate``: the checkpoint's q_proj holds each head's query then its gate (``2d`` rows a head);
    Megatron's group holds its q heads, then their gates, then k and v."""
    d, p = spec.head_dim, spec.heads_per_group
    pre = hf + "self_attn."  # ``hf``: the layer's logical prefix
    q = pre + "q_proj." + suffix
    segs = []
    for g in range(spec.num_kv_heads):
        if gate:
            heads = range(g * p, (g + 1) * p)
            segs += [Segment(q, 2 * d * i, d) for i in heads] + [Segment(q, 2 * d * i + d, d) for i in heads]
        else:
            segs.append(Segment(q, g * p * d, p * d))
        segs.append(Segment(pre + "k_proj." + suffix, g * d, d))
        segs.append(Segment(pre + "v_proj." + suffix, g * d, d))
    return segs


@dataclass(frozen=True)
class QkvGroups(Kind):
    """Megatron's fused QKV: per query group its q heads, k head, v head, globally; a rank
    holds one contiguous window.  ``gate``: the checkpoint's ``q_proj`` holds each head's query
    and output gate (Qwen3-Next), Megatron's group its q heads, then their gates, then k and v."""

    layouts: ClassVar[frozenset[str] | None] = frozenset({"megatron"})
    suffix: str  # weight | bias
    gate: bool = False

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        spec = c.spec
        rows = ((1 + self.gate) * spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim // c.tp
        shape = (rows, spec.hidden_size) if self.suffix == "weight" else (rows,)
        win = (c.rank * rows, (c.rank + 1) * rows)
        segs = qkv_segments(spec, c.hf, self.suffix, self.gate)
        return [Local(name, shape, stacked(name, segs, c.logical, 0, win))]


def kv_heads(tp: int, num_kv_heads: int, rank: int) -> tuple[int, int]:
    """(first kv head, count) an engine's TP ``rank`` holds; consecutive ranks share one when
    TP exceeds the kv heads."""
    if tp >= num_kv_heads:
        return rank // (tp // num_kv_heads), 1
    n = num_kv_heads // tp
    return rank * n, n


@dataclass(frozen=True)
class QkvHeads(Kind):
    """An engine's fused QKV: ``[q (my heads) | k | v (my kv heads)]``, kv heads replicated
    over consecutive ranks when TP exceeds them.  ``gate``: each head's q rows are the
    checkpoint's query and output gate, kept interleaved (SGLang, vLLM)."""

    layouts: ClassVar[frozenset[str] | None] = frozenset({"engine"})
    suffix: str
    gate: bool = False

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        spec, r = c.spec, c.rank
        d, nq = spec.head_dim, spec.num_heads // c.tp
        qd = (1 + self.gate) * d  # a head's q rows: its query, and its output gate when gated
        k0, nkv = kv_heads(c.tp, spec.num_kv_heads, r)
        attn = c.hf + "self_attn."
        segs = [Segment(attn + "q_proj." + self.suffix, r * nq * qd, nq * qd),
                Segment(attn + "k_proj." + self.suffix, k0 * d, nkv * d),
                Segment(attn + "v_proj." + self.suffix, k0 * d, nkv * d)]
        rows = nq * qd + 2 * nkv * d
        shape = (rows, spec.hidden_size) if self.suffix == "weight" else (rows,)
        return [Local(name, shape, stacked(name, segs, c.logical, 0))]


@dataclass(frozen=True)
class ExpertMlps(Kind):
    """Megatron: this rank's local experts, each a dense MLP split over expert-TP
    (``linear_fc1`` = [gate; up] slices, ``linear_fc2`` = down's columns), named by the
    layout's templates (``Cut.experts.names``)."""

    layouts: ClassVar[frozenset[str] | None] = frozenset({"megatron"})
    per_expert: ClassVar[bool] = True
    gate: str  # logical names with ``{e}``
    up: str
    down: str

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        x, H = c.experts, c.spec.hidden_size
        n, f = c.spec.num_experts // x.ep, c.spec.moe_intermediate_size // x.tp
        lo, (fc1, fc2) = x.tp_rank * f, x.names
        ones, twos = [], []
        for j in range(n):
            e = x.ep_rank * n + j
            name1, name2 = c.local + fc1.format(j=j), c.local + fc2.format(j=j)
            segs = [Segment(c.hf + self.gate.format(e=e), lo, f), Segment(c.hf + self.up.format(e=e), lo, f)]
            ones.append(Local(name1, (2 * f, H), stacked(name1, segs, c.logical, 0)))
            down = [Segment(c.hf + self.down.format(e=e), lo, f)]
            twos.append(Local(name2, (H, f), stacked(name2, down, c.logical, 1)))
        if x.grouped:  # TEGroupedMLP registers every fc1 weight, then every fc2
            return ones + twos
        return [t for pair in zip(ones, twos, strict=True) for t in pair]


@dataclass(frozen=True)
class ExpertStacks(Kind):
    """An engine's FusedMoE: this rank's experts stacked, ``w13 [E_loc, 2I/moe_tp, H]`` =
    per expert [gate slice; up slice], ``w2 [E_loc, H, I/moe_tp]``.  ``shared``: the shared
    expert's (gate, up, down), stacked as expert ``E`` where the engine fuses it
    (variant ``shared_fused``)."""

    layouts: ClassVar[frozenset[str] | None] = frozenset({"engine"})
    gate: str
    up: str
    down: str
    shared: tuple[str, str, str] | None = None

    def cut(self, row: str, name: str, c: Cut) -> list[Local]:
        x, H = c.experts, c.spec.hidden_size
        n, f = c.spec.num_experts // x.ep, c.spec.moe_intermediate_size // x.tp
        first, lo = x.ep_rank * n, x.tp_rank * f
        projs = (self.gate, self.up, self.down)
        mlps = [tuple(c.hf + p.format(e=e) for p in projs) for e in range(first, first + n)]
        if self.shared is not None and "shared_fused" in c.variants:  # expert E: the shared one
            mlps.append(tuple(c.hf + p for p in self.shared))
        n = len(mlps)
        w13, w2 = name + ".w13_weight", name + ".w2_weight"
        segs = [Segment(proj, lo, f) for mlp in mlps for proj in mlp[:2]]
        down = [Piece(mlp[2], (0, lo), (H, f), w2, (k * H, 0)) for k, mlp in enumerate(mlps)]
        return [Local(w13, (n * 2 * f, H), stacked(w13, segs, c.logical, 0), (n, 2 * f, H)),
                Local(w2, (n * H, f), down, (n, H, f))]
