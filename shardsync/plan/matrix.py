"""The fallback matrix: which path a sync takes for a topology and a mode, and why.

Every answer comes from the precondition table (``check_p2p``) through ``plan.choose``,
the decision ``WeightSync.connect`` makes; this module only enumerates topologies:

- ``auto``: p2p when every precondition holds, else broadcast, naming the first failure;
- ``p2p``: p2p, or refused with the ``ValueError`` that ``WeightSync.connect`` raises;
- ``broadcast``: always broadcast.

A topology whose trainer or engine layout cannot be built (Megatron or the engine would
refuse that TP) is ``refused`` in every mode: no process of that shape can start, so
there is nothing to fall back to.  ``shardsync plan --matrix`` prints ``render_markdown()``,
which is what ``docs/fallback_matrix.md`` holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

from shardsync.family.section import Indexer, Latent, Linear, Section
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.mode import Mode
from shardsync.plan.choose import choose
from shardsync.plan.preconditions import PRECONDITIONS, Verdict, check_p2p
from shardsync.presets import PRESETS
from shardsync.quant.support import REFUSED
from shardsync.spec import ModelSpec
from shardsync.topology import ENGINE_KINDS, Topology
from shardsync.views import Host, views_of
from shardsync.vocab import Request

MODES = Request.names()
MODELS = ("tiny-qwen2", "tiny-qwen3", "tiny-llama")
# Preconditions whose failure means the deployment itself cannot exist.
_EXISTENCE = ("trainer_layout", "engine_layout")

# TP relation -> (trainer TP, first engine TP) for a spec.
RELATIONS: dict[str, Callable[[ModelSpec], tuple[int, int]]] = {
    "equal": lambda s: (2, 2),
    "trainer > engine": lambda s: (4, 2),
    "trainer < engine": lambda s: (1, 2),
    "engine > kv heads": lambda s: (2, 2 * s.num_kv_heads),
    "engine non-pow2": lambda s: (2, 3),
}


@dataclass(frozen=True, kw_only=True)
class Case:
    """One topology of the matrix (metadata only)."""

    model: str
    relation: str
    trainer_tp: int
    trainer_pp: int = 1
    trainer_dp: int = 1
    trainer_ep: int = 1
    trainer_etp: int | None = None
    engine_tps: tuple[int, ...] = (1,)
    engine_ep: int = 1
    engine_kind: str = "reference"
    engine_pp: int = 1  # reported by an engine whose layout has no stages
    engine_stages: int = 1  # SGLang: pipeline stages in the engine layout
    quantization: str | None = None
    spec_changes: tuple[tuple[str, Any], ...] = ()
    note: str = ""

    def topology(self) -> Topology:
        spec = PRESETS[self.model].replace(**dict(self.spec_changes))
        trainer = MegatronParallel(tp=self.trainer_tp, pp=self.trainer_pp, dp=self.trainer_dp, ep=self.trainer_ep,
                                   etp=self.trainer_etp)
        return Topology(spec, trainer, tuple(EngineParallel(tp=t, ep=self.engine_ep, pp=self.engine_stages)
                                             for t in self.engine_tps),
                        views=views_of(self.quantization), host=Host(self.engine_kind, self.engine_pp))


@dataclass(frozen=True)
class Decision:
    mode: str
    path: str  # "p2p", "broadcast" or "refused"
    why: str   # empty for p2p and for a requested broadcast


@dataclass(frozen=True)
class Entry:
    """A case with its precondition verdicts and the decision of every mode."""

    case: Case
    verdicts: tuple[Verdict, ...] = field(repr=False)

    @property
    def first_failure(self) -> Verdict | None:
        return next((v for v in self.verdicts if not v.ok), None)

    @property
    def impossible(self) -> Verdict | None:
        return next((v for v in self.verdicts if v.name in _EXISTENCE and not v.ok), None)

    @cached_property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(decide(self, m) for m in MODES)


def decide(entry: Entry, mode: str) -> Decision:
    """The path ``WeightSync`` takes for ``entry`` when configured with ``mode``."""
    mode = Request.parse(mode, "mode").value
    if (bad := entry.impossible) is not None:
        return Decision(mode, "refused", f"no such deployment ({bad.name}): {bad.detail}")
    try:
        path, reason = choose({Mode.P2P: entry.verdicts}, mode)
    except ValueError as e:  # what WeightSync.connect raises
        return Decision(mode, "refused", f"ValueError: {e}")
    return Decision(mode, path.value, reason or "")


def grid_cases() -> Iterator[Case]:
    """model x TP relation x trainer PP x engines x engine kind, in a fixed order."""
    for model in MODELS:
        spec = PRESETS[model]
        for relation, tps in RELATIONS.items():
            t_tp, e_tp = tps(spec)
            for pp in (1, 2):
                # The second engine differs in TP from the first (TP 1, or 2 beside a TP 1).
                for engines in ((e_tp,), (e_tp, 1 if e_tp != 1 else 2)):
                    for kind in ENGINE_KINDS:
                        yield Case(model=model, relation=relation, trainer_tp=t_tp, trainer_pp=pp,
                                   engine_tps=engines, engine_kind=kind)


def extra_cases() -> list[Case]:
    """The preconditions the grid never trips (settings outside its axes)."""
    base = partial(Case, model="tiny-qwen3", relation="equal", trainer_tp=2, engine_tps=(2,))
    # 12 heads, 6 KV heads and FFN 768 divide by 3, so an engine of TP 3 exists; the 64-padded
    # vocab (1024) does not, which vLLM's vocab split needs.
    tp3 = partial(Case, model="tiny-qwen2", relation="engine non-pow2", trainer_tp=2, engine_tps=(3,),
               spec_changes=(("num_heads", 12), ("num_kv_heads", 6), ("intermediate_size", 768)))
    return [
        base(engine_kind="tensorrt-llm", note="unknown engine kind"),
        base(engine_pp=2, note="engine runs PP 2"),
        base(engine_kind="sglang", engine_stages=2, note="SGLang PP 2: each stage's ranks get its layers"),
        base(quantization="fp8", note="FP8 engine: the trainer sends e4m3 bytes and scales"),
        base(engine_kind="sglang", quantization="fp8",
             note="SGLang serving block FP8: its host writes e4m3 bytes and scales in place"),
        base(quantization="fp8-per-tensor", note="one scale per tensor: the loader quantizes it whole"),
        base(trainer_tp=3, relation="trainer non-pow2", note="Megatron refuses TP 3 for 8 heads"),
        tp3(note="12 heads, 6 KV heads, FFN 768: TP 3 divides"),
        tp3(engine_kind="vllm", note="same, vLLM: padded vocab 1024 does not split by 3"),
    ]


def moe_cases() -> list[Case]:
    """Expert parallel on either side (tiny-qwen3-moe: 8 experts, 2 KV heads)."""
    moe = partial(Case, model="tiny-qwen3-moe")
    return [
        moe(relation="EP over DP -> experts split over TP", trainer_tp=1, trainer_dp=2, trainer_ep=2,
             engine_tps=(2,), note="EP 2 -> engine EP 1"),
        moe(relation="EP over TP, ETP 1 -> engine EP", trainer_tp=2, trainer_ep=2, trainer_etp=1,
             engine_tps=(2,), engine_ep=2, note="EP 2 ETP 1 -> engine EP 2"),
        moe(relation="expert TP -> engine EP", trainer_tp=2, engine_tps=(4,), engine_ep=4,
             note="ETP 2 -> engine EP 4 (experts whole)"),
        moe(relation="EP 4 -> EP 2 x MoE-TP 2", trainer_tp=1, trainer_dp=4, trainer_ep=4,
             engine_tps=(4,), engine_ep=2, note="EP 4 -> engine EP 2, MoE-TP 2"),
        moe(relation="two engines, different EP", trainer_tp=2, trainer_pp=2, trainer_ep=2, trainer_etp=1,
             engine_tps=(2, 4), engine_ep=2, note="PP 2 EP 2 -> engines TP 2 and 4, EP 2"),
        moe(relation="vLLM partial EP", trainer_tp=2, engine_tps=(4,), engine_ep=2, engine_kind="vllm",
             note="vLLM has EP = TP or none"),
        moe(relation="vLLM EP = TP", trainer_tp=2, engine_tps=(2,), engine_ep=2, engine_kind="vllm",
             note="vLLM --enable-expert-parallel"),
        moe(relation="EP not dividing experts", trainer_tp=1, trainer_dp=3, trainer_ep=3,
             engine_tps=(2,), note="Megatron refuses EP 3 for 8 experts"),
        moe(relation="ETP x EP > TP x DP", trainer_tp=2, trainer_ep=2, engine_tps=(2,),
             note="Megatron refuses ETP 2 x EP 2 on 2 ranks"),
        moe(relation="engine EP > TP", trainer_tp=2, engine_tps=(2,), engine_ep=4,
             note="the engine refuses EP 4 at TP 2"),
    ]


def mla_cases() -> list[Case]:
    """Latent attention (tiny-deepseek-v3: 8 heads, q down projection; -q-proj without it;
    tiny-glm4-moe-lite: GLM's router in float32), experts as above."""
    ds = partial(Case, model="tiny-deepseek-v3")
    return [
        ds(relation="MLA, EP 2 -> EP 2", trainer_tp=2, trainer_ep=2, trainer_etp=1, engine_tps=(2,),
             engine_ep=2, note="TP 2 EP 2 -> engine TP 2 EP 2 (the demo)"),
        ds(relation="MLA heads over more TP", trainer_tp=2, trainer_pp=2, engine_tps=(8,), engine_ep=8,
             note="PP 2 TP 2 -> engine TP 8 EP 8 (one head per rank)"),
        Case(model="tiny-deepseek-v3-q-proj", relation="MLA without q_lora_rank", trainer_tp=1, trainer_dp=2,
             trainer_ep=2, engine_tps=(4,), engine_ep=2, note="q_proj split by heads; kv_a whole"),
        Case(model="tiny-glm4-moe-lite", relation="GLM-4.7-Flash shape", trainer_tp=2, trainer_dp=2, trainer_ep=4,
             trainer_etp=1, engine_tps=(2, 2), engine_ep=2, note="TP 2 EP 4 -> two engines TP 2 EP 2"),
        ds(relation="MLA heads not dividing TP", trainer_tp=2, engine_tps=(3,),
             note="the engine refuses TP 3 for 8 heads"),
        ds(relation="MLA into vLLM", trainer_tp=2, engine_tps=(2,), engine_ep=2, engine_kind="vllm",
             note="vLLM --enable-expert-parallel"),
    ]


def dsa_cases() -> list[Case]:
    """Sparse attention (tiny-glm5: GLM-5's interleaved indexer rotary; tiny-deepseek-v32):
    MLA plus an indexer replicated on every rank of every side."""
    glm = partial(Case, model="tiny-glm5")
    return [
        glm(relation="DSA, EP 2 -> EP 2", trainer_tp=2, trainer_ep=2, trainer_etp=1, engine_tps=(2,),
             engine_ep=2, note="TP 2 EP 2 -> engine TP 2 EP 2 (the demo)"),
        Case(model="tiny-deepseek-v32", relation="DSA heads over more TP", trainer_tp=2, trainer_pp=2,
             engine_tps=(4,), engine_ep=4, note="PP 2 TP 2 -> engine TP 4 EP 4; indexer whole everywhere"),
        glm(relation="GLM-5 shared indexer layers", trainer_tp=2, trainer_dp=2, trainer_ep=4, trainer_etp=1,
             engine_tps=(2, 4), engine_ep=2, spec_changes=(("index_shared_layers", (2,)),),
             note="layer 2 reuses layer 1's choice: no indexer tensors there"),
        glm(relation="DSA into vLLM", trainer_tp=2, engine_tps=(2,), engine_ep=2, engine_kind="vllm",
             note="vLLM fuses wk and weights_proj (wk_weights_proj)"),
    ]


def linear_cases() -> list[Case]:
    """Gated DeltaNet hybrids (tiny-qwen3-next: 4 key heads, 8 value heads; tiny-qwen3.5-moe: the
    projections apart in the checkpoint): linear-attention heads split by whole key-head groups."""
    nxt = partial(Case, model="tiny-qwen3-next")
    return [
        nxt(relation="hybrid, EP 2 -> EP 2", trainer_tp=2, trainer_ep=2, trainer_etp=1, engine_tps=(2,),
             engine_ep=2, note="TP 2 EP 2 -> engine TP 2 EP 2"),
        nxt(relation="linear heads over TP 4", trainer_tp=2, trainer_dp=2, trainer_ep=4, trainer_etp=1,
             engine_tps=(4,), engine_ep=4, note="one key-head group per engine rank"),
        nxt(relation="linear heads not dividing TP", trainer_tp=2, engine_tps=(4,), engine_ep=4,
             spec_changes=(("linear_num_key_heads", 2), ("linear_num_value_heads", 4)),
             note="the engine refuses TP 4 for 2 key heads"),
        Case(model="tiny-qwen3.5-moe", relation="Qwen3.5: projections apart", trainer_tp=2, trainer_pp=2,
             engine_tps=(2, 4), engine_ep=2, note="PP 2 TP 2 -> engines TP 2 and 4, EP 2"),
        nxt(relation="hybrid into vLLM", trainer_tp=2, engine_tps=(2,), engine_ep=2, engine_kind="vllm",
             note="vLLM names the attention self_attn.*"),
    ]


def build(cases: list[Case] | None = None) -> list[Entry]:
    cases = (list(grid_cases()) + extra_cases() + moe_cases() + mla_cases() + dsa_cases() + linear_cases()
             if cases is None else cases)
    return [Entry(c, tuple(check_p2p(c.topology()))) for c in cases]


def _cell(entry: Entry, mode: str) -> str:
    return next(d.path for d in entry.decisions if d.mode == mode)


def _why(entry: Entry) -> str:
    parts = []
    if (bad := entry.impossible) is not None:
        parts.append(f"no such deployment: `{bad.name}`: {bad.detail}")
    failed = entry.first_failure
    if failed is not None and failed != bad:
        parts.append(f"`{failed.name}`: {failed.detail}")
    return "; ".join(parts).replace("|", "\\|")


def _table(entries: list[Entry], with_note: bool) -> list[str]:
    head = "| model | TP relation | trainer | engines TP | kind | auto | p2p | broadcast | why |"
    if with_note:
        head = head.replace("| model |", "| case | model |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for e in entries:
        c = e.case
        trainer = f"TP{c.trainer_tp} PP{c.trainer_pp}" + (f" DP{c.trainer_dp}" if c.trainer_dp > 1 else "")
        if PRESETS[c.model].is_moe:
            trainer += f" EP{c.trainer_ep} ETP{c.trainer_etp or c.trainer_tp}"
        engines = ("+".join(str(t) for t in c.engine_tps) + (f" EP{c.engine_ep}" if PRESETS[c.model].is_moe else "")
                   + (f" PP{c.engine_stages}" if c.engine_stages > 1 else ""))
        cells = [c.model, c.relation, trainer, engines, c.engine_kind,
                 *(_cell(e, m) for m in MODES), _why(e)]
        if with_note:
            cells.insert(0, c.note)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_markdown(entries: list[Entry] | None = None) -> str:
    """The whole matrix as a markdown document (deterministic: same code, same text)."""
    entries = build() if entries is None else entries
    grid = [e for e in entries if not e.case.note]
    extra = [e for e in entries if e.case.note and not PRESETS[e.case.model].is_moe]
    def has(e: Entry, kind: type[Section]) -> bool:
        return PRESETS[e.case.model].find(kind) is not None

    moe = [e for e in entries if e.case.note and PRESETS[e.case.model].is_moe and not has(e, Latent)
           and not has(e, Linear)]
    hybrid = [e for e in entries if e.case.note and has(e, Linear)]
    mla = [e for e in entries if e.case.note and has(e, Latent) and not has(e, Indexer)]
    dsa = [e for e in entries if e.case.note and has(e, Indexer)]
    counts = {p: sum(_cell(e, "auto") == p for e in grid) for p in ("p2p", "broadcast", "refused")}
    out = [
        "# Fallback matrix",
        "",
        "Generated by `shardsync plan --matrix > docs/fallback_matrix.md` from the",
        "precondition table in `shardsync/plan/preconditions.py`; do not edit by hand.",
        "",
        "Each row is one topology; the columns `auto`, `p2p` and `broadcast` give the path",
        "`WeightSync` takes when configured with that mode:",
        "",
        "- `auto`: p2p when every precondition holds, otherwise broadcast; rank 0 logs",
        "  `mode=auto falls back to broadcast: p2p precondition <name> failed: <detail>`.",
        "- `p2p`: p2p, or refused: `connect()` raises `ValueError: mode='p2p' requested but",
        "  p2p precondition <name> failed: <detail>; use mode='auto' or 'broadcast'`.",
        "- `broadcast`: always broadcast.",
        "- `refused` in every column: the trainer or an engine of that shape cannot exist",
        "  (Megatron or the engine refuses the TP), so no path applies.",
        "",
        "`why` names the first failing precondition and its detail (the `<name>` and",
        "`<detail>` above).  Preconditions, in order of evaluation:",
        "",
        *(f"{i}. `{p.name}`: {p.requirement}" for i, p in enumerate(PRECONDITIONS, 1)),
        "",
        "Axes: model (tiny presets, one per family) x TP relation x trainer PP (1, 2) x",
        "engines (one; or two of different TP: the second has TP 1, or TP 2 beside a TP-1",
        "engine) x engine kind.  TP relations: equal 2->2; trainer > engine 4->2;",
        "trainer < engine 1->2; engine > kv heads 2->2*kv (KV heads replicated);",
        "engine non-pow2 2->3.  Engine PP 1, no quantization.",
        "",
        f"Grid: {len(grid)} topologies; with `auto`: {counts['p2p']} p2p, "
        f"{counts['broadcast']} broadcast, {counts['refused']} refused.",
        "",
        *_table(grid, with_note=False),
        "",
        "## Preconditions outside the grid",
        "",
        "Settings the grid does not vary, one row each.  `model_family` and `plan_covers`",
        "cannot fail here: `ModelSpec` refuses an unknown family before a topology exists,",
        "and the planner covers every engine element whenever both layouts build.",
        "",
        *_table(extra, with_note=True),
        "",
        "Quantizations no path can deliver trainer weights into are refused at connect",
        "(`quant/support.py`), whatever the mode:",
        "",
        *(f"- `{name}`: {reason}" for name, reason in REFUSED.items()),
        "",
        "## Mixture of experts",
        "",
        "Expert parallel on either side, in both directions (`tiny-qwen3-moe`).  Trainer: EP",
        "and expert TP (ETP) subdivide each stage's TP x DP ranks as in Megatron-core; engine:",
        "EP blocks of experts within the TP group, each split over MoE-TP = TP / EP (SGLang",
        "`--ep-size`; vLLM only EP 1 or `--enable-expert-parallel`, EP = TP).",
        "",
        *_table(moe, with_note=True),
        "",
        "## Multi-head latent attention",
        "",
        "DeepSeek-V3-shaped models (`tiny-deepseek-v3`, `-q-proj`, `tiny-glm4-moe-lite`): heads split",
        "over TP on every side, the down projections whole on the engines, experts as above.",
        "",
        *_table(mla, with_note=True),
        "",
        "## Sparse attention (DSA)",
        "",
        "GLM-5- and DeepSeek-V3.2-shaped models (`tiny-glm5`, `tiny-deepseek-v32`): latent attention",
        "as above plus each layer's indexer, replicated on every rank of every side (SGLang holds",
        "`weights_proj` in bfloat16 and `k_norm` in float32; vLLM fuses `wk` and `weights_proj`).",
        "",
        *_table(dsa, with_note=True),
        "",
        "## Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5)",
        "",
        "`tiny-qwen3-next` and `tiny-qwen3.5-moe`: three linear-attention layers to one gated",
        "full-attention layer; engines split the linear-attention heads by whole key-head groups (the",
        "checkpoint's interleaved projections stay in order; Qwen3.5's are stacked per rank), Megatron",
        "holds slime's linear-attention module whole on every TP rank.",
        "",
        *_table(hybrid, with_note=True),
        "",
    ]
    return "\n".join(out)
