"""The weight view seam (``shardsync/views``): views composed in order, their defaults leave a
topology as it was, FP8 and adapters retype only through their views, the facts an engine
declares travel as one typed record, and a tensor's role is a field."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from shardsync.control.client import SyncError
from shardsync.control.connect import decide, topology_of
from shardsync.control.wire import Decision, EngineFacts, InfoResponse, LoraMsg
from shardsync.layout import EngineParallel, Layout, MegatronParallel
from shardsync.lora import Lora
from shardsync.models.weights import load_rank, random_source
from shardsync.piece import Role
from shardsync.presets import PRESETS
from shardsync.quant import FORMATS
from shardsync.receiver.connect import spec_to_dict
from shardsync.spec import ModelSpec
from shardsync.topology import Topology
from shardsync.viewed import DERIVERS, deriver
from shardsync.views import (
    NO_VIEWS,
    AdapterView,
    BoundView,
    Fp8Bound,
    Fp8View,
    Host,
    ServedQuantized,
    Views,
    WeightView,
    views_of,
)

DENSE, FP8 = PRESETS["tiny-qwen3"], PRESETS["tiny-qwen3-fp8"]
LORA = Lora(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))


def _topo(spec: ModelSpec, views: Views, host: Host | None = None) -> Topology:
    return Topology(spec, MegatronParallel(tp=2), (EngineParallel(tp=2, dtype=spec.dtype),), views=views,
                    host=host or Host())


def test_views_of_composes_one_view_per_served_fact() -> None:
    assert views_of(None) == NO_VIEWS == Views()
    fp8 = views_of("fp8")
    assert fp8.views == (Fp8View(FORMATS["fp8"]),) and views_of(FORMATS["fp8"]) == fp8  # a name or the format
    assert fp8.quantization == "fp8-block128x128" and fp8.lora is None
    assert views_of("bitsandbytes").views == (ServedQuantized("bitsandbytes"),)  # the engine's own loader quantizes
    adapter = views_of("fp8", LORA)  # an FP8 engine serves its adapter wide: no FP8 on the wire
    assert adapter.views == (AdapterView(LORA), ServedQuantized("fp8")) and adapter.lora == LORA
    assert adapter.find(AdapterView) == AdapterView(LORA) and adapter.find(Fp8View) is None


def test_a_view_with_only_defaults_leaves_the_topology_as_it_was() -> None:
    plain, same = _topo(DENSE, NO_VIEWS), _topo(DENSE, Views((WeightView(),)))
    assert same.trainer_layout == plain.trainer_layout and same.engine_layouts == plain.engine_layouts
    assert same.raw_dtypes == plain.raw_dtypes and same.riders == {} and same.summary() is None
    assert same.fingerprint("p2p") == plain.fingerprint("p2p")
    assert same.fingerprint("broadcast") == plain.fingerprint("broadcast")
    assert deriver(plain, 0, {}, count=False) is None and plain.fp8 is None and plain.lora is None


@dataclasses.dataclass(frozen=True)
class _Renamed(WeightView):
    """A test view: the engine layouts' kind gets ``tag`` appended (to see the order views run in)."""

    tag: str

    def engine_base(self, spec: ModelSpec, engine: EngineParallel, inner: Callable[[], Layout]) -> Layout:
        lay = inner()
        return dataclasses.replace(lay, kind=lay.kind + self.tag)

    def refusal(self, spec: ModelSpec, host: Host) -> str | None:
        return f"refused by {self.tag}"

    def bind(self, topo) -> BoundView:
        return _Tagged(self.tag)


@dataclasses.dataclass(frozen=True)
class _Tagged(BoundView):
    tag: str

    def engine(self, layout: Layout) -> Layout:
        return dataclasses.replace(layout, kind=layout.kind + self.tag.upper())

    def summary(self, engines, itemsize: int) -> str | None:
        return self.tag


def test_views_apply_in_order_and_the_first_refusal_speaks() -> None:
    topo = _topo(DENSE, Views((_Renamed("-a"), _Renamed("-b"))))
    assert topo.engine_bases[0].kind == "engine-a-b"  # each hook gets the previous view's answer
    assert topo.engine_layouts[0].kind == "engine-a-b-A-B"
    assert topo.summary() == "-a\n-b"
    assert topo.views.refusal(topo.spec, topo.host) == "refused by -a"


def test_fp8_and_adapters_retype_only_through_their_views() -> None:
    fp8 = _topo(FP8, views_of("fp8"))
    assert fp8.fp8 is not None and fp8.riders and fp8.trainer_layout is not fp8.trainer_base
    assert fp8.derived(0) and "FP8 on the wire" in (fp8.summary() or "")
    assert set(DERIVERS) == {Fp8Bound}
    params = load_rank(fp8.trainer_base, 0, random_source(FP8, 0))
    made = deriver(fp8, 0, params, count=False)  # the trainer side: rank 0 quantizes its regions
    assert made is not None and {d.words for d in fp8.derived(0)} <= set(made.tensors)
    made.refresh()
    words = made.tensors[fp8.derived(0)[0].words]
    assert words.dtype == torch.int32 and bool(words.ne(0).any())
    rank = fp8.engine_layouts[0].ranks[0]
    roles = {t.role for t in rank.tensors}
    assert roles >= {Role.VALUES, Role.WORDS, Role.SCALES}
    scales = [t for t in rank.tensors if t.role is Role.SCALES]
    assert all(t.parent is not None and rank.tensor(t.parent).role is Role.WORDS for t in scales)
    # an engine kind whose receiver does not quantize: the wire stays wide, and shard-level syncs are refused
    vllm = _topo(FP8, views_of("fp8"), Host("vllm"))
    assert vllm.fp8 is None and vllm.engine_layouts == _topo(FP8, NO_VIEWS).engine_layouts
    refused = vllm.views.refusal(vllm.spec, vllm.host)
    assert refused is not None and "vllm" in refused
    adapter = _topo(DENSE, views_of(None, LORA))
    assert set(adapter.trainer_layout.logical) == {n for n in adapter.engine_layouts[0].logical}
    assert all(".lora_" in n for n in adapter.trainer_layout.logical)
    assert adapter.raw_dtypes == {} and adapter.adapter is not None and adapter.adapter["rank"] == 4
    assert "LoRA adapter of rank 4 alone" in (adapter.summary() or "")


def _info(**kw) -> InfoResponse:
    return InfoResponse(spec=spec_to_dict(DENSE), tp=2, dtype="bfloat16", weight_version=0, stale=False, **kw)


def test_the_engines_facts_are_one_typed_record_from_info_to_topology() -> None:
    d = decide([_info(kind="sglang", quantization="fp8"), _info(kind="sglang", quantization="fp8")], port=1)
    assert d.facts == EngineFacts(kind="sglang", pp=1, quantization="fp8")
    again = Decision.model_validate_json(d.model_dump_json())  # how the other trainer ranks read it
    topo = topology_of(again, DENSE, MegatronParallel(tp=2), relay=False, whole=False)
    assert topo.host == Host("sglang") and topo.views == views_of("fp8")
    with pytest.raises(SyncError, match="engines differ"):
        decide([_info(quantization="fp8"), _info()], port=1)
    with pytest.raises(SyncError, match="MXFP4"):
        decide([_info(quantization="mxfp4")], port=1)
    with pytest.raises(SyncError, match="out of bounds"):
        decide([_info(kind="k" * 100)], port=1)
    with pytest.raises(ValidationError):
        EngineFacts.model_validate({"kind": "reference", "facts": {}})  # no untyped extras
    # an adapter is a ``Lora`` in code and bounded JSON on the wire, both ways
    wired = {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"]}
    assert EngineFacts.model_validate({"lora": wired}).lora == Lora(4, 8.0, ("q_proj", "v_proj"))
    assert EngineFacts(lora=Lora(4, 8.0, ("v_proj", "q_proj"))).model_dump(mode="json")["lora"] == wired
    for bad in ({**wired, "rank": 10**6}, {**wired, "targets": ["lm_head"]}, {**wired, "extra": 1}):
        with pytest.raises(ValidationError):
            EngineFacts.model_validate({"lora": bad})
    lora = LoraMsg(rank=4, alpha=8.0, targets=["q_proj", "v_proj"])
    d = decide([_info(lora=lora)], port=1)
    assert topology_of(d, DENSE, MegatronParallel(tp=2), relay=False, whole=False, lora=LORA).lora == LORA
    with pytest.raises(SyncError, match="syncs no adapter, this engine serves adapter.*--lora-rank"):
        topology_of(d, DENSE, MegatronParallel(tp=2), relay=False, whole=False)


def test_a_plan_disagreement_names_what_the_engines_views_suggest() -> None:
    assert NO_VIEWS.hint() == "" and views_of(None, LORA).hint() == ""
    assert "serves fp8-block128x128: the trainer plans FP8 when the engine reports it" in views_of("fp8").hint()
    assert "serves fp8-per-tensor" in views_of("fp8-per-tensor", LORA).hint()  # an adapter served wide


def test_an_engine_refuses_a_sync_of_another_adapter_through_its_views() -> None:
    other = Lora(rank=8, alpha=8.0, targets=("q_proj",))
    assert views_of(None, LORA).mismatch(LORA) is None and NO_VIEWS.mismatch(None) is None
    served = views_of(None, LORA)
    assert served.mismatch(other) == f"the trainer syncs adapter {other}, this engine serves adapter {LORA}"
    assert NO_VIEWS.mismatch(LORA) == f"the trainer syncs adapter {LORA}, this engine serves no adapter"
    assert views_of("fp8", LORA).mismatch(None) == f"the trainer syncs no adapter, this engine serves adapter {LORA}"
