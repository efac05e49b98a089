"""MoE and MLA on vLLM-CPU (float32): after a shardsync update vLLM serves exactly what a fresh
vLLM load of the same weights serves.

What runs here:
- in-process (``_reload``, TP 1): vLLM loads a checkpoint as its start does; the backend's
  loader path reloads other weights, then the checkpoint's again; every parameter and buffer
  (the prepacked CPU experts, MLA's ``W_UK_T``/``W_UV`` on CPU_MLA) and every linear/MLP output
  equals the fresh load's, bit for bit.  Without ``engines.vllm.moe``'s repack the experts
  keep raw values after a reload (vLLM's unquantized MoE method runs the CPU experts' prepack
  on the first load only) and the MoE output moves by ~0.04.
- a real vLLM server: tiny-qwen3-moe (TP 1) and a tiny DeepSeek-V3 with multi-head latent
  attention on ``--attention-backend CPU_MLA`` (TP 1, TP 2); a single-rank trainer syncs new
  weights; vLLM's greedy tokens equal transformers' and logprobs agree within 1e-5;
  ``verify()`` is empty.
- the MLA engine's parameters are not shardsync's ``vllm`` engine layout beyond names (MLA
  registers the derived ``W_UK_T``/``W_UV`` as parameters; CPU linears and experts are
  repacked): the sync goes whole tensors by broadcast into vLLM's loader, asserted below.

What does not run: vLLM-CPU's MLA needs kv_lora_rank 512 and qk_rope_head_dim 64 (head
size 576), hence the checkpoint below.  Its default MLA backend where the CPU has AMX
(AMX_MLA) cannot load float32 weights ("expect weight to be bfloat16, ...") and its reload
fails in bfloat16 (kv_b_proj is packed to an empty tensor: "shape '[512, 8, 64]' is invalid
for input of size 0"); the backend refuses such an engine at connect, as it refuses one whose
CPU experts vLLM padded (tested in-process with the backend's own ``reload_problem``; no
such server is started).
``VLLM_MLA_DISABLE=1`` (plain attention) serves float32 at start but is not synced here.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from shardsync.config import ControlConfig, SyncConfig, TransportConfig
from shardsync.engines.vllm import serve
from shardsync.layout import MegatronParallel
from shardsync.models.checkpoint import write_checkpoint
from shardsync.models.weights import load_rank
from shardsync.presets import PRESETS
from shardsync.spec import ModelSpec
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from tests.vllm._check import compare, hf_checkpoint_reference, version_source, vllm_generate

TOKEN = "vllm-test-token-0123456789abcdef"
MOE = PRESETS["tiny-qwen3-moe"].replace(name="tiny-qwen3-moe-2l", num_layers=2)
# vLLM-CPU's MLA: kv_lora_rank 512 + rope 64; no MTP layer (vLLM serves no draft here)
MLA = PRESETS["tiny-deepseek-v3"].replace(name="tiny-deepseek-v3-mla576", num_layers=2, kv_lora_rank=512,
                                          qk_rope_head_dim=64, head_dim=32 + 64, num_nextn_predict_layers=0)
CPU_MLA = ("--attention-backend", "CPU_MLA")
CASES = {"moe": (MOE, "default"), "mla": (MLA, "CPU_MLA")}


def _checkpoint(spec: ModelSpec, root: Path, dtype: str = "float32") -> str:
    return str(write_checkpoint(spec, version_source(spec, 0), root, dtype=getattr(torch, dtype)))


def _reload(spec: ModelSpec, backend: str, root: Path, dtype: str = "float32") -> dict:
    """``tests.vllm._reload``'s result on a checkpoint of ``spec`` (its own process, bounded)."""
    ckpt, out = _checkpoint(spec, root / "ckpt", dtype), root / "reload.json"
    r = subprocess.run([sys.executable, "-m", "tests.vllm._reload", ckpt, backend, str(out), dtype],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_reload_equals_fresh_load(case: str, tmp_path) -> None:
    spec, backend = CASES[case]
    res = _reload(spec, backend, tmp_path)
    assert res["refused"] is None, res["refused"]
    assert res["experts"], "no vLLM-CPU MoE experts: the case does not exercise the repack"
    assert res["other_differs"] > 0  # the reload of other weights did reach the model
    assert res["errors"] == [], res["errors"]
    if case == "mla":
        assert len(res["mla"]) == 2 * spec.num_layers, res["mla"]  # W_UK_T, W_UV per layer: compared
    assert res["differ"] == {}, res["differ"]


# engines whose every reload would fail: (spec, attention backend, dtype, what the reason says)
REFUSED = {
    # vLLM's default MLA backend where AMX is (bfloat16: it cannot load float32)
    "amx-mla": (MLA, "default", "bfloat16", ("AMX_MLA", "--attention-backend CPU_MLA")),
    # an expert intermediate size of 48: vLLM-CPU pads it to 64, and its reload cannot copy 96 rows into 128
    "padded-moe": (MOE.replace(moe_intermediate_size=48), "default", "float32", ("padded", "[8, 96, 256]")),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_engine_whose_reload_fails_is_refused_at_connect(case: str, tmp_path) -> None:
    """The backend's ``reload_problem`` (what ``_build`` refuses the connect with) names the cause."""
    spec, backend, dtype, says = REFUSED[case]
    refused = _reload(spec, backend, tmp_path, dtype)["refused"]
    if case == "amx-mla" and not torch.cpu._is_amx_tile_supported():
        # no AMX on this CPU (CI machines differ): vLLM picks CPU_MLA, whose reload works
        assert refused is None, refused
        return
    assert refused and all(s in refused for s in says), refused


SERVERS = {"moe-tp1": (MOE, 1, ()), "mla-tp1": (MLA, 1, CPU_MLA), "mla-tp2": (MLA, 2, CPU_MLA)}


@pytest.fixture(scope="module", params=sorted(SERVERS))
def server(request, tmp_path_factory):
    spec, tp, extra = SERVERS[request.param]
    ckpt = _checkpoint(spec, tmp_path_factory.mktemp("ckpt"))
    log = tempfile.NamedTemporaryFile(prefix="vllm-", suffix=".log", delete=False).name
    proc, url = serve.start(serve.VllmServer(ckpt, tp=tp, extra=extra, env={"SHARDSYNC_TOKEN": TOKEN}),
                            log_path=log, timeout_s=400)
    yield {"name": request.param, "spec": spec, "url": url, "model": ckpt, "tp": tp, "log": log}
    serve.stop(proc)


def test_sync_then_generate_equals_transformers(server, tmp_path) -> None:
    """A single-rank trainer sends version 1 (new weights) into a server started on version 0;
    transformers reads version 1 from a checkpoint (its own key conversion of MoE experts)."""
    spec = server["spec"]
    par = MegatronParallel(tp=1, dtype="float32")
    source = version_source(spec, 1)
    params = load_rank(Topology(spec, par).trainer_layout, 0, source)
    cfg = SyncConfig(control=ControlConfig(channel="vllm", token=TOKEN),
                     transport=TransportConfig(bucket_mb=0.5, timeout_s=60))
    sync = WeightSync(spec, par, 0, params, [server["url"]], cfg)
    try:
        sync.connect()
        connected, fallback = sync.mode.value, sync.fallback_reason
        rec = sync.update(1)
        mismatched = sync.verify()
    finally:
        sync.close()
    assert rec.ok, rec.engines_json()
    assert mismatched == [], mismatched[:5]
    (e,) = rec.engines_json()
    assert e["destination"] == "loader"  # vLLM-CPU repacks linears and experts: its loader takes them
    if spec is MLA:  # W_UK_T/W_UV are parameters shardsync does not send: whole tensors by broadcast
        assert connected == "broadcast" and "W_UK_T" in (fallback or ""), (connected, fallback)
    else:
        assert connected == "p2p", (connected, fallback)
    want = hf_checkpoint_reference(str(write_checkpoint(spec, source, tmp_path / "v1")))
    diff = compare(vllm_generate(server["url"], server["model"]), want)
    assert diff is None, f"{server['name']}: {diff} (vLLM's log: {server['log']})"
