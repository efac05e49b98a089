"""A trainer at TP 2 syncs into a real, unmodified vLLM (TP 1 and TP 2) through vLLM's
weight-transfer plug-in point: p2p, broadcast and a 1 % delta.  After every update vLLM's
greedy tokens equal ``transformers`` on the trainer's weights and logprobs agree within
1e-5 (float32); shardsync's checksums of what every worker holds equal the trainer's.  A
trainer that dies mid-update leaves vLLM paused on its previous weights; a new connect and
a full update bring it back.  An FSDP2 trainer syncs its own shards into the same servers."""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import httpx
import pytest
import torch
import torch.distributed as dist
from prometheus_client.parser import text_string_to_metric_families

from shardsync.config import ControlConfig, DeltaConfig, SyncConfig, TransportConfig
from shardsync.control.client import SyncError
from shardsync.engines.vllm import serve
from shardsync.fsdp2 import fsdp2_parallel, local_shards
from shardsync.layout import MegatronParallel
from shardsync.models.checkpoint import write_checkpoint
from shardsync.models.weights import load_rank
from shardsync.presets import PRESETS
from shardsync.sync import WeightSync
from tests.dist._world import free_port, join_trainer, run_world
from tests.vllm._check import compare, hf_reference, version_source, vllm_generate

MODEL = "tiny-qwen3"
TRAINER_TP = 2
TOKEN = "vllm-test-token-0123456789abcdef"  # vLLM's workers read it from $SHARDSYNC_TOKEN
# (version, mode for update(), base version of a delta or None)
STEPS = ((1, None, None), (2, "broadcast", None), (3, None, 2))


def _server(tmp_path_factory, tp: int, **env):
    spec = PRESETS[MODEL]
    ckpt = write_checkpoint(spec, version_source(spec, 0), tmp_path_factory.mktemp("ckpt"))
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False).name
    proc, url = serve.start(serve.VllmServer(str(ckpt), tp=tp, env={"SHARDSYNC_TOKEN": TOKEN, **env}), log_path=log)
    return {"url": url, "model": str(ckpt), "tp": tp, "proc": proc, "log": log}


@pytest.fixture(scope="module", params=[1, 2], ids=["vllm-tp1", "vllm-tp2"])
def vllm(request, tmp_path_factory):
    server = _server(tmp_path_factory, request.param)
    yield server
    serve.stop(server["proc"])


@pytest.fixture(scope="module")
def vllm_whole(tmp_path_factory):
    """vLLM told to take whole tensors only: what a layout mismatch leads to."""
    server = _server(tmp_path_factory, 2, SHARDSYNC_VLLM_LAYOUT="whole")
    yield server
    serve.stop(server["proc"])


def _load(params, lay, rank, source) -> None:
    for k, v in load_rank(lay, rank, source).items():
        params[k].copy_(v)  # in place: the sync reads the parameters where they live


def _trainer(rank: int, world: int, port: int, url: str, model: str, out) -> None:
    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=world, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=0)
    cfg = SyncConfig(delta=DeltaConfig(transport="p2p"), control=ControlConfig(channel="vllm", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.5, timeout_s=60))
    sync = WeightSync(spec, par, rank, params, [url], cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"connected": sync.mode.value, "fallback": sync.fallback_reason, "steps": []}
    for version, mode, base in STEPS:
        source = version_source(spec, version, base)
        _load(params, lay, rank, source)
        rec = sync.update(version, mode=mode)
        step = {"version": version, "mode": rec.mode, "ok": rec.ok, "engines": rec.engines_json(),
                "mismatched": sync.verify()}
        if rank == 0:
            step["diff"] = compare(vllm_generate(url, model), hf_reference(spec, source))
            step["weight_info"] = httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]
        res["steps"].append(step)
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def _shardsync_samples(url: str) -> dict[tuple[str, tuple], float]:
    """vLLM's /metrics (every process's, shardsync's workers' included), shardsync's samples."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            if f.name.startswith("shardsync_") for s in f.samples}


def test_p2p_broadcast_delta_match_transformers(vllm) -> None:
    before = _shardsync_samples(vllm["url"])
    results = run_world(_trainer, TRAINER_TP, args=(TRAINER_TP, free_port(), vllm["url"], vllm["model"]),
                        timeout=400)
    after = _shardsync_samples(vllm["url"])
    # vLLM's own /metrics counts every update once (one rank per engine observes), by path
    for path in ("p2p", "broadcast", "delta-p2p"):
        ok = ("shardsync_updates_total", (("outcome", "ok"), ("path", path)))
        count = ("shardsync_update_seconds_count", (("path", path),))
        assert after.get(ok, 0) - before.get(ok, 0) == 1, (path, after)
        assert after.get(count, 0) - before.get(count, 0) == 1, (path, after)
    assert after[("shardsync_weight_version", ())] == 3
    r0 = results[0]
    assert r0["connected"] == "p2p"
    modes = [s["mode"] for s in r0["steps"]]
    assert modes == ["p2p", "broadcast", "delta-p2p"], modes
    received = {}
    for s in r0["steps"]:
        assert s["ok"], s
        assert s["mismatched"] == [], s["mismatched"][:5]
        assert s["diff"] is None, (s["mode"], s["diff"])
        assert s["weight_info"] == str(s["version"])
        (e,) = s["engines"]
        assert e["destination"] == "loader"  # CPU vLLM repacks linear weights: its loader takes them
        received[s["mode"]] = e["bytes_received"]  # summed over vLLM's workers
    full = PRESETS[MODEL].num_parameters() * 4
    tp = vllm["tp"]
    # p2p: every worker gets only its TP rank's bytes (the workers together: the model once,
    # plus replicated norms); broadcast: every worker gets the whole model
    assert received["p2p"] < full * 1.01, (received, full)
    assert received["broadcast"] >= tp * full, (received, full)
    assert received["delta-p2p"] < received["p2p"] / 5, received


def test_layout_mismatch_falls_back_to_whole_tensors_by_broadcast(vllm_whole) -> None:
    """A worker whose parameters are not shardsync's layout refuses shards with its reason;
    the trainer reconnects with whole tensors by broadcast (vLLM's loader shards them)."""
    v = vllm_whole
    results = run_world(_trainer, TRAINER_TP, args=(TRAINER_TP, free_port(), v["url"], v["model"]), timeout=400)
    r0 = results[0]
    assert r0["connected"] == "broadcast"
    assert "shardsync's engine layout" in r0["fallback"] and "SHARDSYNC_VLLM_LAYOUT" in r0["fallback"]
    assert [s["mode"] for s in r0["steps"]] == ["broadcast", "broadcast", "delta-broadcast"]
    full = PRESETS[MODEL].num_parameters() * 4
    for s in r0["steps"]:
        assert s["ok"] and s["mismatched"] == [] and s["diff"] is None, s
    (e,) = r0["steps"][0]["engines"]
    assert e["bytes_received"] >= v["tp"] * full  # every worker holds every tensor whole


def _dies_mid_update(rank: int, world: int, port: int, url: str, model: str, out) -> None:
    """Connect, then rank 0 starts an update on vLLM and every rank exits before sending."""
    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=world, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=0)
    cfg = SyncConfig(control=ControlConfig(channel="vllm", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.5, timeout_s=8))
    sync = WeightSync(spec, par, rank, params, [url], cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    if rank == 0:
        from shardsync.control.wire import BeginRequest
        from shardsync.mode import Mode
        ch = sync._channel
        ch.begin(BeginRequest(version=50, mode=Mode.P2P, fingerprint=sync.topo.fingerprint("p2p")))
    out.put((rank, {}))
    time.sleep(1)  # the result reaches the parent (a queue's feeder thread), then:
    os._exit(0)  # a killed trainer: no close, no goodbye


def _recovers(rank: int, world: int, port: int, url: str, model: str, out) -> None:
    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=world, dtype="float32")
    lay, params = join_trainer(rank, world, port, spec, par, seed=0)
    source = version_source(spec, 60)
    _load(params, lay, rank, source)
    cfg = SyncConfig(control=ControlConfig(channel="vllm", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.5, timeout_s=30))
    sync = WeightSync(spec, par, rank, params, [url], cfg, trainer_group=dist.group.WORLD)
    sync.connect()
    rec = sync.update(60)
    res = {"ok": rec.ok, "mismatched": sync.verify()}
    if rank == 0:
        res["diff"] = compare(vllm_generate(url, model), hf_reference(spec, source))
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_trainer_killed_mid_update_leaves_vllm_paused_then_recovers(vllm) -> None:
    url = vllm["url"]
    before = httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]
    run_world(_dies_mid_update, TRAINER_TP, args=(TRAINER_TP, free_port(), url, vllm["model"]), timeout=120)
    # vLLM's workers wait for bytes that never come, then give up (the sync timeout)
    deadline_s = 60
    paused = httpx.get(url + "/is_paused", timeout=deadline_s).json()["is_paused"]
    assert paused, "a failed update must leave vLLM paused"
    assert httpx.get(url + "/weight_info", timeout=10).json()["weight_version"] == before
    assert vllm["proc"].poll() is None, "vLLM died"
    results = run_world(_recovers, TRAINER_TP, args=(TRAINER_TP, free_port(), url, vllm["model"]), timeout=300)
    assert results[0]["ok"] and results[0]["mismatched"] == []
    assert results[0]["diff"] is None, results[0]["diff"]
    assert not httpx.get(url + "/is_paused", timeout=10).json()["is_paused"]


def test_connect_signed_with_another_token_is_refused(vllm) -> None:
    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=1, dtype="float32")
    from shardsync.topology import Topology
    params = load_rank(Topology(spec, par).trainer_layout, 0, version_source(spec, 0))
    sync = WeightSync(spec, par, 0, params, [vllm["url"]],
                      SyncConfig(control=ControlConfig(channel="vllm", token="another-token-0123456789")))
    with pytest.raises(SyncError, match="not signed with this engine's secret"):
        sync.connect()
    sync.close()
    assert vllm["proc"].poll() is None


def test_replayed_join_and_unsigned_update_are_refused(vllm, monkeypatch) -> None:
    """vLLM's weight-transfer routes are open to whoever reaches the port: a captured join
    replayed finds its sync joined already, an update call without the trainer's signature
    is dropped, and the trainer's next update lands as if neither had been tried."""
    from shardsync.control.client import Engines
    from shardsync.topology import Topology

    spec = PRESETS[MODEL]
    par = MegatronParallel(tp=1, dtype="float32")
    params = load_rank(Topology(spec, par).trainer_layout, 0, version_source(spec, 1))
    sent: list[tuple[str, list]] = []
    real = Engines.call

    def record(self, method, path, payloads=None, **kw):
        sent.append((path, payloads))
        return real(self, method, path, payloads, **kw)

    monkeypatch.setattr(Engines, "call", record)
    sync = WeightSync(spec, par, 0, params, [vllm["url"]],
                      SyncConfig(control=ControlConfig(channel="vllm", token=TOKEN),
                                 transport=TransportConfig(timeout_s=60)))
    sync.connect()
    assert sync.update(1).ok
    url = vllm["url"]
    join = next(b[0] for p, b in sent if p == "/init_weight_transfer_engine" and b[0]["init_info"]["join"])
    update = next(b[0] for p, b in sent if p == "/update_weights")
    assert httpx.post(url + "/init_weight_transfer_engine", json=join, timeout=60).status_code != 200
    forged = {"update_info": {"call": {**update["update_info"]["call"], "seq": 99, "version": 7}}}
    httpx.post(url + "/start_weight_update", timeout=60)
    httpx.post(url + "/update_weights", json=forged, timeout=60)
    httpx.post(url + "/finish_weight_update", json={"weight_version": None}, timeout=60)
    log = open(vllm["log"]).read()
    assert "a replayed join; refused" in log and "update call not signed for this connection" in log
    assert vllm["proc"].poll() is None
    for k, v in load_rank(Topology(spec, par).trainer_layout, 0, version_source(spec, 2)).items():
        params[k].copy_(v)
    rec = sync.update(2)
    assert rec.ok and sync.verify() == []
    sync.close()


# --- an FSDP2 trainer ---------------------------------------------------------------------------


def _fsdp2(spec, source, world: int):
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = transformers.AutoConfig.for_model(**spec.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(source(name))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_trainer(rank: int, world: int, port: int, url: str, model_dir: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    spec = PRESETS[MODEL]
    model = _fsdp2(spec, version_source(spec, 1), world)
    sync = WeightSync(spec, fsdp2_parallel(model, dtype="float32"), rank, local_shards(model), [url],
                      SyncConfig(control=ControlConfig(channel="vllm", token=TOKEN),
                                 transport=TransportConfig(bucket_mb=0.5, timeout_s=60)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    res = {"connected": sync.mode.value, "steps": []}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, spec.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    for version, mode in ((1, None), (2, "broadcast")):
        if version == 2:  # one AdamW step on the FSDP2 model: its shards change in place
            logits = model(ids).logits.float()
            (-torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).mean()).backward()
            opt.step()
        rec = sync.update(version, mode=mode)
        full = {n: p.full_tensor().detach() for n, p in model.named_parameters()}  # the test's reference only
        step = {"mode": rec.mode, "ok": rec.ok, "mismatched": sync.verify()}
        if rank == 0:
            step["diff"] = compare(vllm_generate(url, model_dir), hf_reference(spec, full.__getitem__))
        res["steps"].append(step)
        dist.barrier()
    sync.close()
    dist.destroy_process_group()
    out.put((rank, res))


def test_fsdp2_trainer_into_vllm(vllm) -> None:
    """An FSDP2 trainer (real fully_shard on a transformers model, 2 ranks) syncs its own shards:
    p2p, then an AdamW step and a broadcast; vLLM matches transformers on the trainer's weights."""
    got = run_world(_fsdp2_trainer, 2, args=(2, free_port(), vllm["url"], vllm["model"]), timeout=400)
    r0 = got[0]
    assert r0["connected"] == "p2p"
    assert [s["mode"] for s in r0["steps"]] == ["p2p", "broadcast"]
    for rank, res in got.items():
        for s in res["steps"]:
            assert s["ok"] and s["mismatched"] == [], (rank, s)
    for s in r0["steps"]:
        assert s["diff"] is None, (s["mode"], s["diff"])


def test_a_stopped_server_leaves_nothing_behind(tmp_path_factory) -> None:
    """vLLM's CPU workers at TP 2 map broadcast segments they never unlink; ``serve.stop``
    stops the server as it stops itself and removes them: no process of its group, no segment."""
    server = _server(tmp_path_factory, 2)
    pgid = server["proc"].pid
    segments = serve.mapped_segments(pgid)
    assert segments, "vLLM TP 2 maps vllm_dist_* segments (what this test checks is cleaned up)"
    serve.stop(server["proc"])
    assert not [n for n in segments if os.path.exists(f"/dev/shm/{n}")]
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
