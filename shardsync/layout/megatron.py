"""The Megatron-core trainer layout (GPTModel: dense Qwen2/Qwen3/Llama, Qwen3-MoE).

Names, shapes and fused orders follow docs/layouts.md section 1: interleaved
QKV per query group, ``[gate_r; up_r]`` fc1 per shard, vocab padded to
``make_vocab_size_divisible_by * tp``, local layer indices per pipeline stage.
Rank order is Megatron's default (TP fastest, then DP, then PP).  Experts follow
Megatron's second rank generator (ETP fastest, then EP, then expert-DP, then PP): EP rank
``q`` holds experts ``[q*E/ep, (q+1)*E/ep)`` under local indices, each split over ETP
like a dense MLP; the router is replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shardsync.family.cut import Cut, Experts, Local
from shardsync.family.table import Row
from shardsync.gcpause import gc_paused
from shardsync.layout.base import Layout
from shardsync.layout.cut import cut_rows
from shardsync.layout.logical import hf_prefixes, logical_tensors, mtp_layers
from shardsync.piece import Piece, RankLayout, Segment, TensorMeta, stacked, whole
from shardsync.spec import ModelSpec

# Megatron names of (input norm, pre-MLP norm), held whole on every TP rank.  Two spellings:
# norms fused into the next linear (TE spec) or separate modules (local spec).
LAYER_NORM_NAMES = {
    "fused": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
    "separate": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
}
# Local expert j's (fc1, fc2) names: SequentialMLP or TE grouped GEMM.
EXPERT_NAMES = {
    "sequential": ("mlp.experts.local_experts.{j}.linear_fc1.weight",
                   "mlp.experts.local_experts.{j}.linear_fc2.weight"),
    "grouped": ("mlp.experts.linear_fc1.weight{j}", "mlp.experts.linear_fc2.weight{j}"),
}
@dataclass(frozen=True, kw_only=True)
class MegatronParallel:
    """Trainer parallelism.  ``pp_layers`` gives uneven stage sizes (defaults to even)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    pp_layers: tuple[int, ...] | None = None
    make_vocab_size_divisible_by: int = 128
    norm_names: str = "fused"
    dtype: str | None = None
    ep: int = 1  # expert parallel
    etp: int | None = None  # expert tensor parallel (Megatron's default: tp)
    expert_names: str = "sequential"
    kind = "megatron"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def expert_dp(self) -> int:
        """ETP x EP x EDP x PP = world (the expert ranks subdivide each stage's TP x DP)."""
        return self.tp * self.dp // (self.expert_tp * self.ep)

    def data_rank(self, rank: int) -> tuple[int, int]:
        """(DP replica, DP size): which share of a batch ``rank`` trains on."""
        return self.coords(rank)[1], self.dp

    def broadcast_members(self, spec: ModelSpec, stage: int) -> list[int]:
        """A stage's broadcast members, its source first: the ranks that together hold each of
        the stage's tensors, DP replica 0's TP ranks and, for experts, expert-DP replica 0's."""
        ranks = [self.rank(tp_rank=r, dp_rank=0, pp_rank=stage) for r in range(self.tp)]
        if spec.is_moe:
            base = stage * self.tp * self.dp
            ranks += [base + i for i in range(self.expert_tp * self.ep) if base + i not in ranks]
        return ranks

    def primary(self, spec: ModelSpec, rank: int) -> str:
        """Which of ``rank``'s pieces a broadcast gather reads: all (DP replica 0), its experts
        (a member for them only) or none."""
        if self.coords(rank)[1] == 0:
            return "all"
        members = self.broadcast_members(spec, self.coords(rank)[0])
        return "experts" if rank in members else "none"

    def describe(self) -> dict[str, int]:
        out = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        return {**out, "ep": self.ep, "etp": self.expert_tp} if self.ep > 1 or self.etp is not None else out

    def expert_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, edp_rank, ep_rank, etp_rank) of a global rank."""
        within, e = rank % (self.tp * self.dp), self.expert_tp
        return rank // (self.tp * self.dp), within // (e * self.ep), (within // e) % self.ep, within % e

    def rank(self, *, tp_rank: int, dp_rank: int = 0, pp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def stage_layers(self, num_layers: int) -> list[range]:
        """Global layer indices of every stage (local index = position in the range)."""
        if self.pp_layers is not None:
            sizes = list(self.pp_layers)
            if len(sizes) != self.pp or sum(sizes) != num_layers or min(sizes) < 0:
                raise ValueError(
                    f"pp_layers={self.pp_layers} must have pp={self.pp} non-negative entries "
                    f"summing to num_layers={num_layers}"
                )
        else:
            if num_layers % self.pp:
                raise ValueError(
                    f"num_layers={num_layers} is not divisible by pp={self.pp}; "
                    "pass pp_layers for an uneven split"
                )
            sizes = [num_layers // self.pp] * self.pp
        out, start = [], 0
        for n in sizes:
            out.append(range(start, start + n))
            start += n
        return out

    def padded_vocab(self, vocab: int) -> int:
        m = self.make_vocab_size_divisible_by * self.tp
        return -(-vocab // m) * m


def check_megatron(spec: ModelSpec, par: MegatronParallel) -> None:
    """Refuse configs Megatron itself refuses, naming the constraint."""
    t, ng = par.tp, spec.num_kv_heads
    if min(par.tp, par.pp, par.dp, par.ep, par.expert_tp) < 1:  # before any rule divides by them
        raise ValueError(f"Megatron layout of {spec.name} impossible: tp, pp, dp, ep and etp must be >= 1")
    rules = [
        (min(par.tp, par.pp, par.dp) >= 1, "tp, pp and dp must be >= 1"),
        (not (mtp_layers(spec) and spec.tie_word_embeddings and par.pp > 1),
         "MTP layers with tied embeddings under PP > 1 are not modelled (megatron-core's last stage then "
         "shares one embedding copy between the output layer and MTP)"),
        (spec.num_heads % t == 0, f"num_heads={spec.num_heads} not divisible by tp={t}"),
        (ng % t == 0 or t % ng == 0, f"tp={t} must divide or be a multiple of num_kv_heads={ng}"),
        ((spec.num_heads + 2 * ng) * spec.head_dim % t == 0,
         f"fused QKV rows (num_heads + 2*num_kv_heads) * head_dim = "
         f"{(spec.num_heads + 2 * ng) * spec.head_dim} not divisible by tp={t}"),
        (spec.intermediate_size % t == 0 or not any(not spec.sparse_layer(n) for n in range(spec.num_layers)),
         f"intermediate_size={spec.intermediate_size} not divisible by tp={t}"),
        (par.norm_names in LAYER_NORM_NAMES,
         f"norm_names must be one of {sorted(LAYER_NORM_NAMES)}"),
    ]
    e, ep = par.expert_tp, par.ep
    if spec.is_moe:
        rules += [
            (min(e, ep) >= 1, "ep and etp must be >= 1"),
            (par.tp * par.dp % (e * ep) == 0,
             f"etp x ep = {e}x{ep} must divide tp x dp = {par.tp}x{par.dp} (Megatron: ETP x EP x EDP x PP = world)"),
            (spec.num_experts % ep == 0, f"num_experts={spec.num_experts} not divisible by ep={ep}"),
            (spec.moe_intermediate_size % e == 0,
             f"moe_intermediate_size={spec.moe_intermediate_size} not divisible by etp={e}"),
            (par.expert_names in EXPERT_NAMES, f"expert_names must be one of {sorted(EXPERT_NAMES)}"),
            (spec.shared_expert_intermediate_size % t == 0,
             f"shared_expert_intermediate_size={spec.shared_expert_intermediate_size} not divisible by tp={t}"),
        ]
    else:
        rules.append((ep == 1 and par.etp in (None, par.tp),
                      f"ep={ep}/etp={par.etp} apply to mixture-of-experts models only; {spec.name} is dense"))
    for ok, why in rules:
        if not ok:
            raise ValueError(f"Megatron layout of {spec.name} impossible: {why}")
    par.stage_layers(spec.num_layers)


Cuts = dict[tuple[object, ...], list[tuple[Local, str | None]]]


def _cut(rows: tuple[Row, ...], c: Cut, memo: Cuts) -> list[tuple[Local, str | None]]:
    """``cut_rows``, each row cut once per holder: a dense row per TP rank, an expert row per
    (EP, ETP) rank (a stage's ranks repeat both: Kimi-K2's 64 per stage have 8 dense cuts)."""
    out = []
    for i, row in enumerate(rows):
        key = (c.layer, c.local, id(rows), i, (c.experts.ep_rank, c.experts.tp_rank) if row.kind.per_expert
               else c.rank)
        made = memo.get(key)
        if made is None:
            made = memo[key] = cut_rows((row,), c)
        out += made
    return out


def _stage_rank(spec: ModelSpec, par: MegatronParallel, stage: int, tp_rank: int,
                logical: dict[str, tuple[int, ...]], dtype: str,
                expert_rank: tuple[int, int] = (0, 0), memo: Cuts | None = None) -> tuple[list, list]:
    t, r = par.tp, tp_rank
    memo = {} if memo is None else memo
    H, V = spec.hidden_size, spec.vocab_size
    tensors: list[TensorMeta] = []
    pieces: list[Piece] = []

    def add(name: str, shape: tuple[int, ...], new: list[Piece]) -> None:
        tensors.append(TensorMeta(name, shape, dtype))
        pieces.extend(new)

    def vocab_shard(name: str, logical_name: str) -> None:
        rows = par.padded_vocab(V) // t
        seg = [Segment(logical_name, 0, V)]
        add(name, (rows, H), stacked(name, seg, logical, 0, (r * rows, min((r + 1) * rows, V)))
            if r * rows < V else [])

    stages = par.stage_layers(spec.num_layers)
    first, last = stage == 0, stage == par.pp - 1
    if first or (last and mtp_layers(spec)):  # MTP embeds on the last stage: its own copy there (PP > 1)
        vocab_shard("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    attn_norm, mlp_norm = LAYER_NORM_NAMES[par.norm_names]
    names, variants = {"attn_norm": attn_norm, "mlp_norm": mlp_norm}, frozenset({par.norm_names})
    ep_rank, etp_rank = expert_rank
    fc1, fc2 = EXPERT_NAMES[par.expert_names]
    experts = Experts(par.ep, ep_rank, par.expert_tp, etp_rank, (fc1, fc2), par.expert_names == "grouped")
    for local, layer in enumerate(stages[stage]):
        c = Cut(spec, layer, f"decoder.layers.{local}.", t, r, logical, names, variants=variants, experts=experts)
        for block in spec.family_table.blocks(spec, layer):
            for made, row_dtype in _cut(block.megatron, c, memo):
                tensors.append(made.meta(row_dtype or dtype))
                pieces.extend(made.pieces)
    if last:
        add("decoder.final_layernorm.weight", (H,),
            [whole("decoder.final_layernorm.weight", "model.norm.weight", logical)])
        head = spec.family_table.mtp
        for k, layer in enumerate(mtp_layers(spec)):  # megatron-core builds MTP on the last stage
            assert head is not None, "MTP layers exist only with a family's MTP head"
            hf_inner, hf_outer = hf_prefixes(spec, layer)
            outer = Cut(spec, layer, f"mtp.layers.{k}.", t, r, logical, variants=variants, hf_prefix=hf_outer,
                        experts=experts)
            inner = dataclasses.replace(outer, local=f"mtp.layers.{k}.transformer_layer.", names=names,
                                        hf_prefix=hf_inner)
            for block, c in ((head.before, outer), *((b, inner) for b in spec.family_table.blocks(spec, layer)),
                             (head.after, outer)):
                for made, row_dtype in _cut(block.megatron, c, memo):
                    tensors.append(made.meta(row_dtype or dtype))
                    pieces.extend(made.pieces)
        if not spec.tie_word_embeddings:
            vocab_shard("output_layer.weight", "lm_head.weight")
        elif par.pp > 1:
            # Tied with PP>1: the last stage keeps its own copy of the embedding (§6.5).
            vocab_shard("output_layer.weight", "model.embed_tokens.weight")
    return tensors, pieces


@gc_paused
def megatron_layout(spec: ModelSpec, par: MegatronParallel) -> Layout:
    """The trainer layout over ``par.world_size`` ranks (DP replicas hold identical pieces)."""
    check_megatron(spec, par)
    logical = logical_tensors(spec)
    dtype = par.dtype or spec.dtype
    cache: dict[tuple[int, int, int, int], RankLayout] = {}
    memo: Cuts = {}
    ranks = []
    for g in range(par.world_size):
        s, dp_rank, r = par.coords(g)
        _, _, ep_rank, etp_rank = par.expert_coords(g) if spec.is_moe else (0, 0, 0, 0)
        key = (s, r, ep_rank, etp_rank)
        if key not in cache:  # DP replicas share one tensors and one pieces tuple
            tensors, pieces = _stage_rank(spec, par, s, r, logical, dtype, (ep_rank, etp_rank), memo)
            cache[key] = RankLayout("", tuple(tensors), tuple(pieces))
        held = cache[key]
        label = f"pp{s}.dp{dp_rank}.tp{r}" + (f".ep{ep_rank}.etp{etp_rank}" if spec.is_moe else "")
        ranks.append(RankLayout(label, held.tensors, held.pieces))
    params: tuple[tuple[str, object], ...] = (("tp", par.tp), ("pp", par.pp), ("dp", par.dp))
    if spec.is_moe:
        params += (("ep", par.ep), ("etp", par.expert_tp))
    return Layout("megatron", spec, logical, tuple(ranks), params)
