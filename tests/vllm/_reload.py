"""Does shardsync's vLLM loader path leave a model exactly as a fresh vLLM load of the same
weights?  Run in its own process (it builds a vLLM model in-process, TP 1, CPU):

    python -m tests.vllm._reload CKPT ATTENTION_BACKEND OUT_JSON [DTYPE]

vLLM loads ``CKPT`` as its start does (``load_model``: load, then its post-load processing)
and records every parameter and buffer (prepacked experts, MLA's ``W_UK_T``/``W_UV``) and the
output of every linear and MLP module on fixed random inputs.  Then the backend's
``loader_for`` reloads other weights (seed 999) and ``CKPT``'s again; what differs from the
first record is written to ``OUT_JSON`` (``{"differ": {name: max abs diff}}``).  An engine
the backend refuses at connect is not reloaded: ``{"refused": reason}``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import checkpoint_source, random_source
from shardsync.receiver import Slice
from shardsync.spec import spec_from_config
from shardsync.store.rendezvous import free_port

Record = dict[str, torch.Tensor | str]


def record(model: torch.nn.Module, vllm_config, hidden: int) -> Record:
    """Every parameter and buffer, and every linear/MLP module's output on seeded inputs."""
    from vllm.forward_context import set_forward_context

    out: Record = {}
    g = torch.Generator().manual_seed(0)
    dtype = vllm_config.model_config.dtype
    with torch.no_grad(), set_forward_context(None, vllm_config):
        for name, mod in model.named_modules():
            width = getattr(mod, "input_size", None)  # vLLM's linear layers (a oneDNN handle on CPU)
            if name.endswith(".mlp"):
                width = hidden
            if width is None or name.endswith("experts") or "embed" in name or "lm_head" in name:
                continue
            x = torch.randn(3, width, generator=g).to(dtype)
            try:
                y = mod(x)
                out["out:" + name] = (y[0] if isinstance(y, tuple) else y).clone()
            except Exception as e:  # a module that needs more than an input (noted, compared as text)
                out["out:" + name] = f"{type(e).__name__}: {e}"[:200]
        for name, b in model.named_buffers():
            out["buffer:" + name] = b.clone()
        for name, p in model.named_parameters():
            out["param:" + name] = p.detach().clone()
    return out


def differ(want: Record, got: Record) -> dict[str, object]:
    bad: dict[str, object] = {}
    for k, w in want.items():
        g = got.get(k)
        if isinstance(w, str) or isinstance(g, str) or g is None:
            if w != g:
                bad[k] = [str(w)[:120], str(g)[:120]]
        elif w.shape != g.shape:
            bad[k] = ["shape", list(w.shape), list(g.shape)]
        elif not torch.equal(w, g):
            bad[k] = float((w.float() - g.float()).abs().max())
    return bad


def fresh_load(vllm_config) -> torch.nn.Module:
    """vLLM's ``BaseModelLoader.load_model`` on CPU, step by step (its own call ends in
    ``torch.accelerator.empty_cache``, which raises where no accelerator is)."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc = vllm_config.model_config
    loader = get_model_loader(vllm_config.load_config)
    with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=vllm_config, model_config=mc)
        loader.load_weights(model, mc)
        process_weights_after_loading(model, mc, torch.device("cpu"))
    return model.eval()


def whole(source, names, dtype: torch.dtype) -> list[Slice]:
    """Every tensor whole, in the engine's dtype (what the loader path stages)."""
    out = []
    for n in names:
        t = source(n).to(dtype)
        out.append(Slice(n, (0,) * t.dim(), tuple(t.shape), t))
    return out


def main(ckpt: str, backend: str, dtype: str = "float32") -> dict:
    torch.set_num_threads(1)
    port = free_port("127.0.0.1")
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    from shardsync.engines.vllm import moe
    from shardsync.engines.vllm.backend import loader_for, reload_problem

    args = EngineArgs(model=ckpt, dtype=dtype, tensor_parallel_size=1, enforce_eager=True, max_model_len=512,
                      max_num_seqs=8, attention_backend=None if backend == "default" else backend)
    vc = args.create_engine_config()
    mc = vc.model_config
    spec = spec_from_config(json.load(open(os.path.join(ckpt, "config.json"))), name="reload")
    names = logical_tensors(spec)
    with set_current_vllm_config(vc):
        init_worker_distributed_environment(vc, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        model = fresh_load(vc)
        refused = reload_problem(model)
        if refused:  # the backend refuses this engine at connect: never reloaded
            return {"refused": refused}
        fresh = record(model, vc, spec.hidden_size)
        load = loader_for(model, mc, mc.dtype)
        load(iter(whole(random_source(spec, seed=999), names, mc.dtype)))  # other weights: a stale value shows
        after_other = record(model, vc, spec.hidden_size)
        load(iter(whole(checkpoint_source(ckpt), names, mc.dtype)))
        after = record(model, vc, spec.hidden_size)
    return {"refused": None, "differ": differ(fresh, after), "other_differs": len(differ(fresh, after_other)),
            "compared": len(fresh), "experts": [e.name for e in moe.cpu_experts(model)],
            "mla": sorted(k for k in fresh if k.endswith((".W_UK_T", ".W_UV"))),
            "errors": sorted(k for k, v in fresh.items() if isinstance(v, str))}


if __name__ == "__main__":
    result = main(sys.argv[1], sys.argv[2], *sys.argv[4:5])
    with open(sys.argv[3], "w") as f:
        json.dump(result, f, indent=1)
