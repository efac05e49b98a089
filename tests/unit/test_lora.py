"""The adapter as tables (``lora/``): its config, its layouts on trainer and engines, the merge's
placement in an engine rank's base shard, and the connect checks that name a different adapter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardsync.control.session import Conflict
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout
from shardsync.lora import ALL_LINEAR, Lora, adapter_tensors, engine_adapter_layout, megatron_adapter_layout
from shardsync.lora.merge import merge_plan
from shardsync.models.weights import random_source
from shardsync.plan.local import region
from shardsync.presets import PRESETS
from shardsync.receiver.connect import check_connect, connect_request
from shardsync.store.rendezvous import Rendezvous
from shardsync.topology import Topology
from shardsync.views import views_of

SPEC = PRESETS["tiny-qwen3"]
LORA = Lora(8, 16.0)


def test_config_is_peft_s_and_refuses_what_it_cannot_adapt() -> None:
    assert Lora(8, 16.0).scale == 2.0 and Lora(8, 16.0).targets == ALL_LINEAR
    assert Lora(4, 8.0, ("v_proj", "q_proj")).targets == ("q_proj", "v_proj")  # one spelling: table order
    with pytest.raises(ValueError, match="rank must be >= 1"):
        Lora(0, 1.0)
    with pytest.raises(ValueError, match="lm_head"):
        Lora(8, 16.0, ("q_proj", "lm_head"))
    assert Lora.from_dict(LORA.to_dict()) == LORA


def test_adapter_tensors_are_peft_s_names_and_shapes() -> None:
    t = adapter_tensors(SPEC, LORA)
    q = SPEC.num_heads * SPEC.head_dim
    assert t["model.layers.0.self_attn.q_proj.lora_A.weight"] == (8, SPEC.hidden_size)
    assert t["model.layers.0.self_attn.q_proj.lora_B.weight"] == (q, 8)
    assert t["model.layers.1.mlp.down_proj.lora_A.weight"] == (8, SPEC.intermediate_size)
    assert len(t) == 2 * len(ALL_LINEAR) * SPEC.num_layers


@pytest.mark.parametrize("layout", ["trainer-tp2", "trainer-tp2-pp2", "engine-tp2"])
def test_every_rank_s_pieces_cover_the_adapter_once_per_replica(layout: str) -> None:
    if layout.startswith("trainer"):
        par = MegatronParallel(tp=2, pp=2 if "pp2" in layout else 1)
        lay = megatron_adapter_layout(SPEC, LORA, par)
        groups = [[par.rank(tp_rank=r, pp_rank=s) for r in range(2)] for s in range(par.pp)]
    else:
        lay = engine_adapter_layout(SPEC, LORA, EngineParallel(tp=2))
        groups = [[0, 1]]
    lay.validate()
    covered = {n: torch.zeros(s, dtype=torch.int32) for n, s in lay.logical.items()}
    for ranks in groups:
        for r in ranks:
            for p in lay.ranks[r].pieces:
                covered[p.logical][region(p.offsets, p.sizes)] += 1
    # column targets: A whole on every TP rank, B split; row targets the other way round
    for name, count in covered.items():
        column = ".o_proj." not in name and ".down_proj." not in name
        whole = (".lora_A." in name) == column
        assert torch.all(count == (2 if whole else 1)), name


def test_megatron_names_are_the_canonical_adapters() -> None:
    names = [t.name for t in megatron_adapter_layout(SPEC, LORA, MegatronParallel(tp=2)).ranks[0].tensors]
    assert names[:4] == ["decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_in.weight",
                         "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_q.linear_out.weight",
                         "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_k.linear_in.weight",
                         "decoder.layers.0.self_attention.linear_qkv.adapter.adapter_k.linear_out.weight"]
    assert "decoder.layers.1.mlp.linear_fc2.adapter.linear_out.weight" in names


def test_adapters_the_engines_cannot_hold_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="mla attention"):
        adapter_tensors(PRESETS["tiny-deepseek-v3"], LORA)
    with pytest.raises(ValueError, match="mixture-of-experts layer"):
        adapter_tensors(PRESETS["tiny-qwen3-moe"], LORA)
    adapter_tensors(PRESETS["tiny-qwen3-moe"], Lora(8, 16.0, ("q_proj", "o_proj")))  # attention only: fine
    with pytest.raises(ValueError, match="replicates KV heads"):
        engine_adapter_layout(SPEC, LORA, EngineParallel(tp=2 * SPEC.num_kv_heads))



def test_an_fsdp2_trainer_s_adapter_is_split_by_rows() -> None:
    """PEFT under ``fully_shard``: each adapter tensor's rows over the shard group (torch.chunk)."""
    from shardsync.layout.fsdp2 import Fsdp2Parallel

    lay = Topology(SPEC, Fsdp2Parallel(shard=2), views=views_of(None, LORA)).trainer_layout
    lay.validate()
    a = "model.layers.0.self_attn.q_proj.lora_A.weight"
    assert [r.tensor(a).shape for r in lay.ranks] == [(4, SPEC.hidden_size), (4, SPEC.hidden_size)]
    assert set(lay.logical) == set(adapter_tensors(SPEC, LORA))


def test_a_lora_topology_plans_the_adapter_alone() -> None:
    topo = Topology(SPEC, MegatronParallel(tp=2), (EngineParallel(tp=2, dtype=SPEC.dtype),), views=views_of(None, LORA))
    whole = dataclasses.replace(topo, views=views_of(None, None))
    assert topo.engine_held == set(adapter_tensors(SPEC, LORA))
    assert sum(topo.p2p_plan.bytes_per_dst().values()) < 0.1 * sum(whole.p2p_plan.bytes_per_dst().values())
    assert topo.fingerprint("p2p") != whole.fingerprint("p2p")
    assert topo.adapter is not None and topo.adapter["rank"] == 8 and whole.adapter is None


@pytest.mark.parametrize("tp", [1, 2])
def test_the_merge_lands_where_the_full_merge_would(tp: int) -> None:
    """Every step of every rank, applied to the rank's base shard, gives the rank's shard of
    W + scale * B @ A computed from the full tensors (fused QKV and gate/up rows included)."""
    par = EngineParallel(tp=tp, dtype="float32")
    base_lay, ad_lay = engine_layout(SPEC, par), engine_adapter_layout(SPEC, LORA, par)
    base, adapter = random_source(SPEC, 1), random_source(SPEC, 2, shapes=adapter_tensors(SPEC, LORA))
    from shardsync.models.weights import load_rank

    for r in range(tp):
        held = load_rank(base_lay, r, base)
        ad = load_rank(ad_lay, r, adapter)
        steps = merge_plan(SPEC, base_lay.ranks[r], ad_lay.ranks[r], LORA)
        touched = {n: torch.zeros_like(t, dtype=torch.int32) for n, t in held.items()}
        for s in steps:
            a = ad[s.a][:, s.a_cols[0]:s.a_cols[0] + s.a_cols[1]]
            b = ad[s.b][s.b_rows[0]:s.b_rows[0] + s.b_rows[1]]
            held[s.base][region(s.offsets, s.sizes)] += LORA.scale * (b @ a)
            touched[s.base][region(s.offsets, s.sizes)] += 1
        for p in base_lay.ranks[r].pieces:
            module = p.logical.removesuffix(".weight")
            if module + ".lora_A.weight" not in ad_lay.logical:
                assert not touched[p.local][region(p.local_offsets, p.sizes)].any(), p.local
                continue
            term = adapter(module + ".lora_B.weight") @ adapter(module + ".lora_A.weight")
            full = base(p.logical) + LORA.scale * term
            assert torch.all(touched[p.local][region(p.local_offsets, p.sizes)] == 1), p.local
            got = held[p.local][region(p.local_offsets, p.sizes)]
            assert torch.allclose(got, full[region(p.offsets, p.sizes)], rtol=0, atol=1e-7), p.local


def test_an_engine_serving_another_adapter_refuses_the_connect() -> None:
    topo = Topology(SPEC, MegatronParallel(tp=1), (EngineParallel(tp=1, dtype=SPEC.dtype),), views=views_of(None, LORA))
    rdv = Rendezvous("127.0.0.1", 1, 2, "x")
    req = connect_request(topo, 0, {"p2p": topo.fingerprint("p2p")}, rdv, bucket_bytes=1 << 20, credits=2,
                          ipc=None, control="store")
    assert check_connect(req, SPEC, 1, SPEC.dtype, views=views_of(None, LORA)) == {"p2p": topo.fingerprint("p2p")}
    for served in (None, Lora(16, 32.0)):
        with pytest.raises(Conflict, match="--lora-rank|this engine serves"):
            check_connect(req, SPEC, 1, SPEC.dtype, views=views_of(None, served))


def test_the_command_line_flags_name_an_adapter_both_ways() -> None:
    import argparse

    from shardsync.engine.launch import EngineConfig, engine_command
    from shardsync.lora.flags import add_lora_args, lora_flags, lora_of

    p = argparse.ArgumentParser()
    add_lora_args(p, "rank")
    odd = Lora(rank=8, alpha=3.0, targets=("q_proj", "v_proj"))
    assert lora_of(p.parse_args(lora_flags(odd))) == odd and lora_flags(None) == []
    cmd = engine_command(EngineConfig(model="tiny-qwen3", port=1, lora=odd, lora_merge=True))
    assert cmd[cmd.index("--lora-rank") + 1] == "8" and "--lora-merge" in cmd
    assert "--lora-rank" not in engine_command(EngineConfig(model="tiny-qwen3", port=1, lora_merge=True))
