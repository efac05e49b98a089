"""Engine layout variants (``EngineParallel.variants``): SGLang's fused shared expert is
expert ``E`` of the stacks, vLLM names MLA's fused down projection its own way; a variant
changes the plan's fingerprint, travels in the connect request, and is refused where the
engine cannot hold it.  (SGLang's own classes: ``tests/sglang``.)"""

from __future__ import annotations

import pytest

from shardsync.layout import EngineParallel, MegatronParallel, engine_layout, full_layout
from shardsync.layout.engine import variant_choices
from shardsync.mode import Mode
from shardsync.plan import build_plan
from shardsync.presets import PRESETS
from shardsync.receiver.connect import connect_request, topology_from_connect
from shardsync.store.rendezvous import Rendezvous
from shardsync.topology import Topology
from shardsync.vocab import Channel

FUSED = frozenset({"shared_fused"})
DEEPSEEK = PRESETS["tiny-deepseek-v3"]


def _tensors(par: EngineParallel, rank: int = 0) -> dict:
    return {t.name: t for t in engine_layout(DEEPSEEK, par).ranks[rank].tensors}


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_shared_expert_is_the_last_expert_of_the_stacks(tp) -> None:
    E, f, H = DEEPSEEK.num_experts, DEEPSEEK.moe_intermediate_size // tp, DEEPSEEK.hidden_size
    lay = engine_layout(DEEPSEEK, EngineParallel(tp=tp, variants=FUSED))
    for r, rank in enumerate(lay.ranks):
        held = {t.name: t.held for t in rank.tensors}
        assert held["model.layers.1.mlp.experts.w13_weight"] == (E + 1, 2 * f, H)
        assert held["model.layers.1.mlp.experts.w2_weight"] == (E + 1, H, f)
        assert not any("shared_experts" in t.name for t in rank.tensors)
        shared = [p for p in rank.pieces if p.local == "model.layers.1.mlp.experts.w13_weight"
                  and "shared_experts" in p.logical]
        # gate then up rows of this rank's slice, after the E routed experts' 2f rows each
        assert sorted(p.local_offsets[0] for p in shared) == [E * 2 * f, E * 2 * f + f]
        assert {p.offsets[0] for p in shared} == {r * f}
    full = full_layout(DEEPSEEK)
    assert sum(c.numel for c in build_plan(lay, full).copies) == DEEPSEEK.num_parameters()


def test_vllm_names_the_fused_down_projection_and_the_experts_its_way() -> None:
    sglang, vllm = _tensors(EngineParallel(tp=2)), _tensors(EngineParallel(tp=2, variants=frozenset({"vllm"})))
    renames = {"self_attn.fused_qkv_a_proj_with_mqa.": "self_attn.fused_qkv_a_proj.",
               "mlp.experts.": "mlp.experts.routed_experts."}

    def theirs(name: str) -> str:
        for a, b in renames.items():
            name = name.replace(a, b)
        return name

    assert {theirs(n) for n in sglang} == set(vllm)
    assert all(vllm[theirs(n)].shape == t.shape and vllm[theirs(n)].held == t.held for n, t in sglang.items())


@pytest.mark.parametrize(("model", "par", "why"), [
    ("tiny-deepseek-v3", EngineParallel(tp=2, ep=2, variants=FUSED), "EP 1 only"),
    ("tiny-qwen3-moe", EngineParallel(tp=2, variants=FUSED), "one shared expert"),
    ("tiny-deepseek-v3", EngineParallel(tp=2, variants=frozenset({"fp8"})), "unknown layout variants"),
])
def test_a_variant_the_engine_cannot_hold_is_refused(model, par, why) -> None:
    with pytest.raises(ValueError, match=why):
        engine_layout(PRESETS[model], par)


def test_variant_choices_try_the_planned_variants_first() -> None:
    assert variant_choices(DEEPSEEK, EngineParallel(tp=2)) == (frozenset(), FUSED)
    assert variant_choices(DEEPSEEK, EngineParallel(tp=2, variants=FUSED)) == (FUSED, frozenset())
    assert variant_choices(DEEPSEEK, EngineParallel(tp=2, ep=2)) == (frozenset(),)  # fusion needs EP 1
    assert variant_choices(PRESETS["tiny-qwen3-moe"], EngineParallel(tp=2)) == (frozenset(),)


def test_variants_change_the_fingerprint_and_travel_in_the_connect() -> None:
    trainer = MegatronParallel(tp=2, ep=2, etp=1, dtype="float32")
    plain = Topology(DEEPSEEK, trainer, (EngineParallel(tp=2, dtype="float32"),))
    fused = Topology(DEEPSEEK, trainer, (EngineParallel(tp=2, dtype="float32"), EngineParallel(
        tp=2, dtype="float32", variants=FUSED)))
    assert plain.fingerprint("p2p") != Topology(DEEPSEEK, trainer, (EngineParallel(
        tp=2, dtype="float32", variants=FUSED),)).fingerprint("p2p")
    rdv = Rendezvous("127.0.0.1", 1234, 10, "t", "gloo", 30.0)
    req = connect_request(fused, 1, {"p2p": fused.fingerprint("p2p")}, rdv, bucket_bytes=1 << 20, credits=2, ipc=None,
                          control=Channel.STORE)
    assert req.engine_variants == [[], ["shared_fused"]]
    again = topology_from_connect(req, "float32")
    assert [e.variants for e in again.engines] == [frozenset(), FUSED]
    assert again.fingerprint(Mode.P2P.value) == fused.fingerprint("p2p")
