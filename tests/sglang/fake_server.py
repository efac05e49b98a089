"""``FakeSglang``: a stand-in for SGLang's HTTP server, which needs a GPU build that does not
run here.  What it fakes is the front: routes, the scheduler's session rules and pause
state, the weight version.  What it runs is SGLang's own: request bodies are validated by
SGLang's request schemas, ``/server_info`` is a real ``ServerArgs.resolved_dict()``, and
one process per TP rank holds SGLang's real model class and calls the custom loader
through SGLang's real ``WeightUpdater`` (deserializing with its ``MultiprocessingSerializer``
and its safe unpickler).  As in SGLang, an exception out of the loader kills the rank and
the server with it.  Every call is logged in ``events`` for the tests to read.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from shardsync.control.sglang import ENTRY
from shardsync.engines.sglang.fp8 import KV_CACHE_SCALES
from tests.sglang import _lora, _models

ROUTES = {  # POST route -> SGLang's request schema (sglang.srt.managers.io_struct)
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/load_lora_adapter": "LoadLoRAAdapterReqInput",
    "/unload_lora_adapter": "UnloadLoRAAdapterReqInput",
}


def _rank_main(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int, ep_size: int, variants: frozenset[str], spec,
               dtype: str, initial: str, env: dict, lora: dict | None, quantization: str | None, conn) -> None:
    """One TP rank's scheduler: SGLang's model and WeightUpdater, driven over ``conn``
    (``quantization``: "fp8", SGLang's block FP8 config, 128 x 128, as an FP8 checkpoint's)."""
    os.environ.update(env)
    from prometheus_client import values  # the fork server imported it before the directory was set:

    values.ValueClass = values.get_value_class()  # choose as a process started with it would
    torch.set_num_threads(1)
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
    from sglang.srt.utils.common import MultiprocessingSerializer

    dt = getattr(torch, dtype)
    stage = dict(pp_rank=pp_rank, pp_size=pp_size, ep_size=ep_size, shared_fused="shared_fused" in variants,
                 indexer_fused="indexer_fused" in variants,
                 quant_config=None if quantization is None else _models.fp8_config(spec))
    model = _models.build(_models.hf_config(spec), tp_rank, tp_size, dt, loaders=(ENTRY,), **stage)
    from safetensors.torch import load_file

    _models.sglang_load(model, load_file(initial))  # the checkpoint the server starts from
    adapters = None  # SGLang's LoRA manager, when the server serves an adapter
    if lora is not None:
        adapters = _lora.manager(model, _models.hf_config(spec), rank=lora["rank"], targets=lora["targets"], dtype=dt)
        _lora.load_ref(adapters, lora["ref"])
    updater = WeightUpdater(tp_rank=tp_rank, device="cpu", gpu_id=0, model_config=None, custom_weight_loaders=[ENTRY],
                            get_model=lambda: model, update_model_fields=None, recapture_cuda_graph=None,
                            get_model_runner=None)
    conn.send(("ready", None))
    while True:
        op, arg = conn.recv()
        if op == "stop":
            return
        try:
            if op == "tensor":  # a scheduler deserializes its own rank's payload only
                named = MultiprocessingSerializer.deserialize(arg["payloads"][tp_rank])
                conn.send(("ok", updater.update_weights_from_tensor(named, load_format=arg["load_format"])))
            elif op == "begin":
                updater.begin_weight_update()
                conn.send(("ok", None))
            elif op == "end":
                updater.end_weight_update(run_post_load=arg)
                conn.send(("ok", None))
            elif op == "compare":  # what SGLang's own loader makes of these full tensors, bit for bit
                ref = _models.sglang_load(_models.build(_models.hf_config(spec), tp_rank, tp_size, dt, **stage), arg)
                _models.publish_rank(tp_rank, tp_size, dtype, (ENTRY,), pp_rank, pp_size, ep_size)
                want = {**dict(ref.named_parameters()), **_models.derived(ref)}
                got = {**dict(model.named_parameters()), **_models.derived(model)}
                # an FP8 config's KV-cache scales are not weights: nothing syncs them (SGLang's loader sets 1.0)
                bad = [n for n in want if not n.endswith(KV_CACHE_SCALES)
                       and (n not in got or not torch.equal(got[n].data, want[n].data))]
                conn.send(("ok", bad))
            elif op == "params":
                conn.send(("ok", {n: p.data.clone() for n, p in model.named_parameters()}))
            elif op == "lora_unload":
                out = adapters.unload_lora_adapter(arg)
                conn.send(("ok", (out.success, out.error_message)))
            elif op == "lora_load":
                try:
                    _lora.load_ref(adapters, arg)
                    conn.send(("ok", (True, None)))
                except RuntimeError as e:  # SGLang answers a failed load, the scheduler lives
                    conn.send(("ok", (False, str(e))))
            elif op == "lora_compare":  # the served slot vs SGLang's own load of these PEFT tensors, bit for bit
                ref = next(iter(adapters.lora_refs.values()))
                got = _lora.slot_buffers(adapters, ref)
                fresh = _models.build(_models.hf_config(spec), tp_rank, tp_size, dt, **stage)
                mgr = _lora.manager(fresh, _models.hf_config(spec), rank=lora["rank"], targets=lora["targets"],
                                    dtype=dt)
                want = _lora.slot_buffers(mgr, _lora.load_tensors(mgr, arg["tensors"], arg["config"]))
                _models.publish_rank(tp_rank, tp_size, dtype, (ENTRY,), pp_rank, pp_size, ep_size)
                conn.send(("ok", [n for n in want if not torch.equal(got[n], want[n])]))
        except BaseException:  # SGLang's scheduler dies on any exception of a weight update
            conn.send(("died", traceback.format_exc()))
            raise


def _trainer_float32(spec) -> frozenset[str]:
    """The checkpoint tensors a Megatron trainer holds in float32 whatever its dtype (the family
    rows': DeepSeek's router expert bias)."""
    from shardsync.layout import MegatronParallel
    from shardsync.topology import Topology

    rank = Topology(spec, MegatronParallel(dtype="bfloat16")).trainer_layout.ranks[0]
    fp32 = {t.name for t in rank.tensors if t.dtype == "float32"}
    return frozenset(p.logical for p in rank.pieces if p.local in fp32)


def fp8_quantizer():
    """The quantizer of the FP8 checkpoints the stand-in serves: float32 block scales (the
    DeepSeek-V3 / Qwen3 FP8 checkpoints'), as ``--quantization fp8`` with 128 x 128 blocks holds."""
    from shardsync.quant import fp8_format, quantize

    fmt = fp8_format("fp8")
    return lambda t: quantize(t, fmt)


class FakeSglang:
    """One SGLang server of ``tp`` x ``pp`` ranks serving ``spec``, started with shardsync's loader
    (experts over ``ep``; ``variants``: what SGLang fuses on CUDA, forced: ``shared_fused``, the
    shared expert among the routed ones; ``indexer_fused``, the indexer's ``wk_weights_proj``)."""

    def __init__(self, spec, tp: int, initial: dict, *, pp: int = 1, ep: int = 1,
                 variants: frozenset[str] = frozenset(), dtype: str = "float32", env: dict | None = None,
                 ctx=None, lora: dict | None = None, quantization: str | None = None) -> None:
        """``lora``: serve one adapter, ``{name, path, rank, targets}`` (``--lora-paths NAME=PATH``);
        ``quantization``: "fp8" serves ``initial``, a block FP8 checkpoint (``--quantization fp8``)."""
        from sglang.srt.server_args import ServerArgs

        self.spec, self.tp, self.pp, self.dtype, self.quantization = spec, tp, pp, dtype, quantization
        lora_args = {} if lora is None else {
            "enable_lora": True, "lora_paths": [f"{lora['name']}={lora['path']}"], "max_lora_rank": lora["rank"],
            "lora_target_modules": lora["targets"], "lora_backend": "torch_native"}
        self.args = ServerArgs(model_path=spec.name, tp_size=tp, pp_size=pp, ep_size=ep, device="cpu", dtype=dtype,
                               custom_weight_loader=[ENTRY], quantization=quantization, **lora_args)
        self.lora = lora
        self.lora_refs: dict[str, object] = {}  # SGLang's registry: adapter name -> its loaded reference
        if lora is not None:  # --lora-paths: loaded at start, under a reference every rank shares
            from sglang.srt.lora.lora_registry import LoRARef

            ref = LoRARef(lora_id=LoRARef.deterministic_id(lora["name"], lora["path"]), lora_name=lora["name"],
                          lora_path=lora["path"], pinned=False)
            self.lora_refs[lora["name"]] = ref
            lora = {**lora, "ref": ref}
        self.events: list[tuple[str, object]] = []
        self.paused = False
        self.session: dict | None = None  # {"loaded": bool} while a weight-update session is open
        self.weight_version = "default"
        self.dead: str | None = None
        self._lock = threading.Lock()
        # SGLang under --enable-metrics: every process writes its Prometheus values under one
        # directory, set before they start, and the server's /metrics reads them all
        self.metrics_dir = tempfile.mkdtemp(prefix="fake-sglang-metrics-")
        # the initial weights as a checkpoint file (a process start passes a descriptor per tensor otherwise)
        checkpoint = os.path.join(self.metrics_dir, "initial.safetensors")
        from safetensors.torch import save_file

        save_file({n: t.contiguous() for n, t in initial.items()}, checkpoint)
        env = {**(env or {}), "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir}
        ctx = ctx or mp.get_context("spawn")
        self._conns, self._procs = [], []
        for r in range(tp * pp):  # stage-major, as SGLang numbers its world
            mine, theirs = ctx.Pipe()
            args = (r % tp, tp, r // tp, pp, ep, variants, spec, dtype, checkpoint, env, lora, quantization, theirs)
            p = ctx.Process(target=_rank_main, args=args, daemon=True)
            p.start()
            self._conns.append(mine)
            self._procs.append(p)
        for r, c in enumerate(self._conns):
            self._wait(r, c, 300, "build its model")
            c.recv()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        threading.Thread(target=self._http.serve_forever, daemon=True).start()

    # -- the ranks --

    def _ranks(self, op: str, arg=None, timeout: float = 300) -> list:
        for c in self._conns:
            c.send((op, arg))
        out = []
        for r, c in enumerate(self._conns):
            self._wait(r, c, timeout, f"answer {op}")
            status, value = c.recv()
            if status == "died":
                self.dead = f"tp{r}: {value}"
                raise RuntimeError(f"SGLang rank {r} died: {value}")
            out.append(value)
        return out

    def _wait(self, r: int, conn, timeout: float, what: str) -> None:
        """Until rank ``r`` answers (bounded); a rank that died takes the server down."""
        deadline = time.monotonic() + timeout
        while not conn.poll(0.2):
            if not self._procs[r].is_alive():
                self.dead = f"tp{r} exited with {self._procs[r].exitcode}"
                raise RuntimeError(f"SGLang rank {r} died before it could {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang rank {r} did not {what} in {timeout}s")

    def compare(self, tensors: dict[str, torch.Tensor]) -> list[list[str]]:
        """Per rank: the parameters that differ from SGLang's own load of ``tensors``."""
        with self._lock:
            return self._ranks("compare", tensors)

    def compare_version(self, version: int, base: int | None = None) -> list[list[str]]:
        """``compare`` against the full tensors of a test version (``tests.vllm._check``)."""
        from shardsync.layout.logical import logical_tensors
        from tests.vllm._check import version_source

        source = version_source(self.spec, version, base)
        kept = _trainer_float32(self.spec)  # a trainer sends these in float32 whatever its dtype
        full = {n: source(n).to(torch.float32 if n in kept else getattr(torch, self.dtype))
                for n in logical_tensors(self.spec)}
        if self.quantization is not None:
            full = _models.fp8_checkpoint(full, fp8_quantizer(), _models.fp8_names(self.spec))
        return self.compare(full)

    def params(self) -> list[dict[str, torch.Tensor]]:
        with self._lock:
            return self._ranks("params")

    def stop(self) -> None:
        self._http.shutdown()
        for c, p in zip(self._conns, self._procs, strict=True):
            if p.is_alive():
                try:
                    c.send(("stop", None))
                except OSError:
                    pass
            p.join(10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def metrics(self) -> bytes:
        """``/metrics`` as SGLang serves it (``add_prometheus_middleware``): a registry that
        collects every process's values from the shared directory."""
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=self.metrics_dir)
        return generate_latest(registry)

    # -- the routes --

    def _post(self, path: str, body: dict) -> tuple[int, dict]:
        import pydantic
        from sglang.srt.managers import io_struct

        req = pydantic.TypeAdapter(getattr(io_struct, ROUTES[path])).validate_python(body)
        self.events.append((path, body))
        if path == "/pause_generation":
            self.paused = True
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            self.paused = False
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path in ("/load_lora_adapter", "/unload_lora_adapter"):
            return self._lora(path, req)
        if path == "/update_weight_version":
            self.weight_version = req.new_version
            return 200, {"success": True, "message": f"Weight version updated to {req.new_version}",
                         "new_version": req.new_version}
        if path == "/begin_weight_update":
            if self.session is not None:
                return 400, {"success": False, "message": "a weight-update session is already open; "
                                                          "call end_weight_update() first"}
            self._ranks("begin")
            self.session = {"loaded": False}
            return 200, {"success": True, "message": "Success"}
        if path == "/end_weight_update":
            if self.session is None:
                return 400, {"success": False, "message": "no weight-update session is open; call "
                                                          "begin_weight_update() first"}
            self._ranks("end", not self.session["loaded"])
            self.session = None
            return 200, {"success": True, "message": "Success"}
        # /update_weights_from_tensor
        if self.session is None:
            return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                      "begin_weight_update() and end_weight_update()"}
        answers = self._ranks("tensor", {"payloads": req.serialized_named_tensors, "load_format": req.load_format})
        ok = all(a[0] for a in answers)
        if ok:
            self.session["loaded"] = True
            if req.weight_version is not None:
                self.weight_version = req.weight_version
        return (200 if ok else 400), {"success": ok, "message": answers[0][1]}

    def _lora(self, path: str, req) -> tuple[int, dict]:
        """SGLang's adapter routes: its registry names a reference per load, every rank runs it."""
        from sglang.srt.lora.lora_registry import LoRARef

        if path == "/unload_lora_adapter":
            ref = self.lora_refs.pop(req.lora_name, None)
            if ref is None:
                return 400, {"success": False, "error_message": f"LoRA adapter {req.lora_name} is not loaded"}
            answers = self._ranks("lora_unload", ref)
        else:
            if req.lora_name in self.lora_refs:
                return 400, {"success": False, "error_message": f"LoRA adapter {req.lora_name} is already loaded"}
            ref = LoRARef(lora_name=req.lora_name, lora_path=req.lora_path, pinned=False)
            answers = self._ranks("lora_load", ref)
            if all(ok for ok, _ in answers):
                self.lora_refs[req.lora_name] = ref
        bad = next((msg for ok, msg in answers if not ok), None)
        return (400, {"success": False, "error_message": bad}) if bad else (200, {"success": True})

    def compare_adapter(self, tensors: dict[str, torch.Tensor], config: dict) -> list[list[str]]:
        """Per rank, the pool buffers of the served adapter unlike SGLang's own load of ``tensors``."""
        return self._ranks("lora_compare", {"tensors": tensors, "config": config})

    def _get(self, path: str) -> tuple[int, dict]:
        if path == "/health":
            return 200, {}
        if path == "/server_info":
            return 200, {**json.loads(json.dumps(self.args.resolved_dict(), default=str)), "version": "0.5.23"}
        if path == "/model_info":
            return 200, {"model_path": self.spec.name, "weight_version": self.weight_version, "is_generation": True}
        return 404, {"detail": "Not Found"}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                if server.dead:
                    return self._answer(502, {"detail": "server is down"})
                if self.path == "/metrics":
                    raw = server.metrics()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                    return
                self._answer(*server._get(self.path.split("?")[0]))

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                if server.dead:
                    return self._answer(502, {"detail": "server is down"})
                if self.path == "/fake/compare":  # the stand-in's own route, for the tests
                    return self._answer(200, {"mismatched": server.compare_version(**body)})
                if self.path not in ROUTES:
                    return self._answer(404, {"detail": "Not Found"})
                try:
                    with server._lock:
                        self._answer(*server._post(self.path, body))
                except Exception as e:
                    self._answer(500, {"detail": str(e)[:2000]})

        return Handler
