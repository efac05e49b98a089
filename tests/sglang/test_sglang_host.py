"""The rank host SGLang's loader builds from the live model (``engines.sglang.host``): which
destination it takes and which engines it refuses, with the reason the trainer will read."""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from shardsync.control.sglang import Checked, SglangCall
from shardsync.engines.sglang import host as sglang_host
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.receiver import connect_request
from shardsync.receiver.hosted import Call
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.store.sealed import get
from shardsync.topology import Topology
from tests.sglang import _models


def _host(model: str, tp: int = 2, rank: int = 1, **stage) -> sglang_host.SglangHost:
    return sglang_host.SglangHost(_models.build(_models.hf_config(_models.SPECS[model]), rank, tp, **stage))


def test_live_parameters_are_received_in_place() -> None:
    h = _host("tiny-qwen3")
    assert h.problem is None and h.rank.layout_reason is None
    assert (h.tp_rank, h.tp_size, h.pp, h.index) == (1, 2, 1, 1)
    dest = h._receiver(False).destination
    live = dict(h.model.named_parameters())
    assert dest.name == "params" and all(dest.tensors()[n].data_ptr() == live[n].data_ptr() for n in live)


def test_pipeline_stage_rank_index_is_sglangs_world_rank() -> None:
    h = _host("tiny-qwen3", tp=2, rank=1, pp_rank=1, pp_size=2)
    assert (h.pp_rank, h.pp, h.index) == (1, 2, 3) and h.rank.layout_reason is None


@pytest.mark.parametrize("backend", ["flashinfer_cutlass", "triton_kernel"])
def test_moe_backend_with_its_own_layout_takes_whole_tensors_with_the_reason(monkeypatch, backend) -> None:
    assert _host("tiny-qwen3-moe").rank.layout_reason is None  # auto: the triton layout
    monkeypatch.setattr(sglang_host, "moe_backend", lambda: backend)
    why = _host("tiny-qwen3-moe").rank.layout_reason
    assert why is not None and backend in why and "--moe-runner-backend triton" in why


def test_layout_override_and_mismatched_checkpoints_name_the_reason(monkeypatch) -> None:
    monkeypatch.setenv("SHARDSYNC_SGLANG_LAYOUT", "whole")
    assert "SHARDSYNC_SGLANG_LAYOUT=whole" in _host("tiny-qwen3").rank.layout_reason
    monkeypatch.delenv("SHARDSYNC_SGLANG_LAYOUT")
    # SGLang's Qwen3-MoE ignores mlp_only_layers: a checkpoint with a dense layer differs by name
    spec = _models.SPECS["tiny-qwen3-moe"].replace(mlp_only_layers=(0,))
    why = sglang_host.SglangHost(_models.build(_models.hf_config(spec), 0, 1)).rank.layout_reason
    assert why is not None and "parameter names differ" in why and "model.layers.0.mlp" in why


def test_calls_without_a_connection_change_nothing() -> None:
    h = _host("tiny-qwen3")
    for p in h.model.parameters():
        torch.nn.init.constant_(p, 0.5)
    before = {n: p.detach().clone() for n, p in h.model.named_parameters()}
    h.rank.update(Call(seq=1, version=3, mode="p2p"))  # no connection: ignored, never raises
    assert all(torch.equal(before[n], p) for n, p in h.model.named_parameters())


def test_rebound_parameters_are_followed() -> None:
    """A session that rebinds a parameter (a repacking method may) must not leave the receive
    writing into the old storage."""
    h = _host("tiny-qwen3")
    rx = h._receiver(False)
    assert not h.follow_params()
    name, param = next(iter(h.model.named_parameters()))
    param.data = torch.zeros_like(param.data)  # new storage, same parameter object
    assert h.follow_params()
    assert rx.destination.tensors()[name].data_ptr() == param.data_ptr()
    assert rx._tensors()[name].data_ptr() == param.data_ptr()  # the views the paths write through


def _call(h: sglang_host.SglangHost, *, expires_in: float = 60.0, **fields) -> SglangCall:
    return SglangCall(name=RDV_NAME, expires=time.time() + expires_in, **fields).signed(h.secret)


RDV_NAME = "replay-test"


def test_a_join_needs_this_ranks_fresh_nonce_and_a_replay_finds_it_spent(monkeypatch) -> None:
    """Each accepted check gives the rank a one-time nonce (in its signed answer); only a join
    carrying it runs, once: a captured join replayed, or one without the nonce, is refused,
    and so is an expired call.  (The check and join themselves are stand-ins here: their plans
    and group are tested with a real trainer in test_sglang_sync.)"""
    h = _host("tiny-qwen3")
    joins: list[dict] = []
    monkeypatch.setattr(h.rank, "check", lambda connect, mac: None)
    monkeypatch.setattr(h.rank, "join", lambda connect, mac, **kw: joins.append(connect))
    spec = _models.SPECS["tiny-qwen3"]
    topo = Topology(spec, MegatronParallel(tp=1), (EngineParallel(tp=2),))
    rdv = Rendezvous("127.0.0.1", free_port(), 3, RDV_NAME, timeout_s=10)
    store = open_store(rdv, is_master=True)
    connect = connect_request(topo, 0, {"p2p": "f"}, rdv, bucket_bytes=1 << 20, credits=2, ipc=None,
                              control="store").model_dump(mode="json")
    h.run(_call(h, op="check", attempt=1, connect=connect))
    answer = get(store, Keys(RDV_NAME).rank_checked(1, 0, h.index), Checked, datetime.timedelta(seconds=10),
                 h.secret)
    assert answer.error is None and answer.nonce
    mine = {str(h.index): answer.nonce}
    h.run(_call(h, op="join", connect=connect))  # no nonce
    h.run(_call(h, op="join", connect=connect, nonces={str(h.index): "0" * 32}))  # another one
    h.run(_call(h, op="join", connect=connect, nonces=mine, expires_in=-1))  # expired
    assert joins == []
    join = _call(h, op="join", connect=connect, nonces=mine)
    h.run(join)
    h.run(join)  # replayed: its nonce is spent
    assert len(joins) == 1
    h.run(_call(h, op="check", attempt=2, connect=connect))  # a new check, a new nonce
    again = get(store, Keys(RDV_NAME).rank_checked(2, 0, h.index), Checked, datetime.timedelta(seconds=10), h.secret)
    assert again.nonce not in (None, answer.nonce)
    h.run(join)  # the old nonce does not open the new check's join
    assert len(joins) == 1
