"""When shard-level p2p may run: a table of named preconditions, checked in order.

``mode="auto"`` takes p2p only when every row holds; otherwise it falls back to
broadcast and logs the first failing row's name and detail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardsync.family import FAMILIES, MOE_FAMILIES
from shardsync.quant.fp8 import FORMATS
from shardsync.quant.support import RECEIVER_QUANTIZES
from shardsync.topology import ENGINE_KINDS, Topology


@dataclass(frozen=True)
class Precondition:
    name: str
    requirement: str
    check: Callable[[Topology], bool]


@dataclass(frozen=True)
class Verdict:
    name: str
    ok: bool
    detail: str


def _builds(attr: str) -> Callable[[Topology], bool]:
    def check(topo: Topology) -> bool:
        getattr(topo, attr)
        return True
    return check


def _vllm_vocab(topo: Topology) -> bool:
    if topo.host.kind != "vllm":
        return True
    padded = -(-topo.spec.vocab_size // 64) * 64
    return all(padded % e.tp == 0 for e in topo.engines)


PRECONDITIONS: tuple[Precondition, ...] = (
    Precondition("model_family", f"model family is one of {sorted(FAMILIES)} (MoE: {list(MOE_FAMILIES)})",
                 lambda t: FAMILIES.get(t.spec.family) is not None),  # the registry knows it
    Precondition("engine_layout_known", f"engine kind is one of {list(ENGINE_KINDS)}",
                 lambda t: t.host.kind in ENGINE_KINDS),
    Precondition("engine_pp_1", "engines run without pipeline parallelism (engine PP = 1), except those "
                 "whose stages are planned per rank (SGLang)",
                 lambda t: t.host.pp == 1),
    Precondition("quantization", "engines hold unquantized weights, or FP8 with shardsync's receiver (the trainer "
                 "quantizes the blocks it holds whole, the receiver what arrives wide; "
                 f"engine kinds {sorted(RECEIVER_QUANTIZES)}, formats {sorted(FORMATS)}); other "
                 "quantized engines take whole tensors through their own loader",
                 lambda t: t.views.refusal(t.spec, t.host) is None),
    Precondition("vllm_vocab_split", "for vLLM, the 64-padded vocab divides by every engine TP",
                 _vllm_vocab),
    Precondition("vllm_experts", "for vLLM, experts are split over TP (ep 1) or placed whole per rank "
                 "(--enable-expert-parallel: ep = tp)",
                 lambda t: t.host.kind != "vllm" or all(e.ep in (1, e.tp) for e in t.engines)),
    Precondition("trainer_layout", "the Megatron layout of the trainer config can be built",
                 _builds("trainer_layout")),
    Precondition("engine_layout", "every engine's layout can be built", _builds("engines_layout")),
    Precondition("plan_covers", "the p2p plan writes every engine element exactly once",
                 _builds("p2p_plan")),
)


def check_p2p(topo: Topology) -> list[Verdict]:
    """Every row of the table, in order; rows after a failure are still evaluated when possible."""
    out = []
    failed = False
    for pre in PRECONDITIONS:
        if failed and pre.name in ("plan_covers",):
            out.append(Verdict(pre.name, False, "not checked: an earlier precondition failed"))
            continue
        try:
            ok, detail = bool(pre.check(topo)), ""
        except ValueError as e:
            ok, detail = False, str(e).splitlines()[0]
        if not ok and not detail:
            detail = f"required: {pre.requirement}"
        failed |= not ok
        out.append(Verdict(pre.name, ok, detail))
    return out


def first_failure(topo: Topology) -> Verdict | None:
    return next((v for v in check_p2p(topo) if not v.ok), None)
