"""Tokens/s of the reference engine (``EngineModel``) at TP 1 and 2 against ``transformers``.

One run, same weights everywhere (``random_source``), fp32, CPU:

- engine TP ``t``: a spawned gloo world of ``t`` processes, one torch thread each;
- transformers (``Qwen3ForCausalLM``, eager attention) in its own spawned process with ``t``
  torch threads, so both sides use the same number of cores.

Measured per side: prefill tokens/s (one forward over ``--prefill-batch x --prefill-len``
tokens, no cache) and decode tokens/s (greedy generation with a KV cache: engine
``generate(temperature=0)``, transformers ``generate(do_sample=False, use_cache=True)``).
Decode is the marginal rate ``(N-1) / (t(N new tokens) - t(1 new token))``, so the prompt's
prefill is not counted.  The machine this was written for is a small shared VM, so the
sides alternate: ``--rounds`` rounds, each spawning every side afresh (engine first in even
rounds, transformers first in odd ones), each process timing ``--repeat`` runs after one
warm-up.  A number uses the fastest of its runs (the least disturbed one); the JSON keeps
every time.  The greedy tokens of each side are compared too: same weights, so they agree
unless a near-tie flips under different rounding.

    python benchmarks/engine_forward.py            # writes out/engine_forward.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from shardsync.launch.procs import run_ranks
from shardsync.presets import PRESETS
from shardsync.spec import ModelSpec
from shardsync.store import free_port

SEED = 0
WORLD_TIMEOUT_S = 1800


def bench_spec(layers: int) -> ModelSpec:
    """A ~54M-parameter Qwen3-like decoder (tied 32k vocab, GQA 8/4, head_dim 64), fp32."""
    return PRESETS["tiny-qwen3"].replace(
        name=f"bench-qwen3-{layers}L", hidden_size=512, num_layers=layers, num_heads=8,
        num_kv_heads=4, head_dim=64, intermediate_size=1536, vocab_size=32000,
        max_position_embeddings=4096, dtype="float32")




def _times(fn: Callable[[], Any], repeat: int, barrier: Callable[[], None]) -> list[float]:
    """Wall times of ``repeat`` runs of ``fn`` after one warm-up; ranks start each together."""
    times = []
    for i in range(repeat + 1):
        barrier()
        t0 = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def _inputs(spec: ModelSpec, args: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1)
    prefill = torch.randint(0, spec.vocab_size, (args["prefill_batch"], args["prefill_len"]),
                            generator=g)
    prompt = torch.randint(0, spec.vocab_size, (args["prompt_len"],), generator=g).tolist()
    return prefill, prompt


def _rates(args: argparse.Namespace, times: dict[str, list[float]]) -> dict[str, float]:
    """Tokens/s from the fastest run of each measurement (and the medians, for the JSON)."""
    best = {k: min(v) for k, v in times.items()}
    n = args.new_tokens
    return {"prefill_tok_s": args.prefill_batch * args.prefill_len / best["prefill"],
            "decode_tok_s": (n - 1) / max(best["generate_n"] - best["generate_1"], 1e-9),
            "best_s": best, "median_s": {k: statistics.median(v) for k, v in times.items()}}


# --- the two sides, each run in spawned processes --------------------------------------------


def _engine_rank(rank: int, world: int, port: int, spec: ModelSpec, args: dict[str, Any]) -> dict:
    import torch.distributed as dist

    from shardsync.models.engine import EngineModel
    from shardsync.models.weights import random_source

    group = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        group = dist.group.WORLD
    try:
        model = EngineModel.from_source(spec, random_source(spec, SEED), rank, world, group)
        barrier = dist.barrier if world > 1 else (lambda: None)
        prefill, prompt = _inputs(spec, args)
        n, repeat = args["new_tokens"], args["repeat"]
        with torch.no_grad():
            times = {
                "prefill": _times(lambda: model(prefill), repeat, barrier),
                "generate_1": _times(lambda: model.generate([prompt], 1, temperature=0.0),
                                     repeat, barrier),
                "generate_n": _times(lambda: model.generate([prompt], n, temperature=0.0),
                                     repeat, barrier),
            }
            (tokens, _), = model.generate([prompt], n, temperature=0.0)
    finally:
        if world > 1:
            dist.destroy_process_group()
    return {"times": times, "tokens": tokens}


def _transformers_proc(rank: int, world: int, port: int, spec: ModelSpec,
                       args: dict[str, Any]) -> dict:
    import transformers

    from shardsync.models.weights import random_source

    torch.set_num_threads(args["threads"])
    config = transformers.AutoConfig.for_model(**spec.to_hf_config())
    hf = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32).eval()
    source = random_source(spec, SEED)
    with torch.no_grad():
        for name, param in hf.named_parameters():  # a tied lm_head is not listed separately
            param.copy_(source(name))
    # Always generate exactly N tokens (no eos in a random model's config to stop at).
    hf.generation_config.eos_token_id = None
    prefill, prompt = _inputs(spec, args)
    ids = torch.tensor([prompt])
    n, repeat = args["new_tokens"], args["repeat"]

    def generate(new: int) -> torch.Tensor:
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                          do_sample=False, use_cache=True, pad_token_id=0)
        assert out.shape[1] == len(prompt) + new, out.shape
        return out

    def no_barrier() -> None:
        pass

    with torch.no_grad():
        times = {
            "prefill": _times(lambda: hf(prefill, use_cache=False), repeat, no_barrier),
            "generate_1": _times(lambda: generate(1), repeat, no_barrier),
            "generate_n": _times(lambda: generate(n), repeat, no_barrier),
        }
        tokens = generate(n)[0, len(prompt):].tolist()
    return {"times": times, "tokens": tokens, "transformers": transformers.__version__}


def _entry(rank: int, fn: Callable[..., dict], world: int, port: int, spec: ModelSpec,
           args: dict[str, Any], threads: int, out: Any) -> None:
    torch.set_num_threads(threads)
    try:
        out.put((rank, fn(rank, world, port, spec, args)))
    except BaseException:
        out.put((rank, {"error": traceback.format_exc()}))
        raise


def _spawn(fn: Callable[..., dict], nprocs: int, threads: int, spec: ModelSpec,
           args: dict[str, Any]) -> dict:
    """Run ``fn`` on ``nprocs`` fresh processes of ``threads`` torch threads; rank 0's result."""
    results = run_ranks(_entry, nprocs, (fn, nprocs, free_port(), spec, args, threads),
                        timeout_s=WORLD_TIMEOUT_S, threads=threads)
    for rank, res in sorted(results.items()):
        if "error" in res:
            raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
    return results[0]


# --- report -----------------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{platform.node()}: {os.cpu_count()} CPUs ({cpu}), {platform.platform()}"


def _run_rounds(spec: ModelSpec, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (TP, side) pair once per round, sides alternating; all times pooled per pair."""
    common = {k: getattr(args, k) for k in
              ("prefill_batch", "prefill_len", "prompt_len", "new_tokens", "repeat")}
    pooled: dict[tuple[int, str], dict[str, Any]] = {}
    for rnd in range(args.rounds):
        for tp in args.tp:
            sides = ("engine", "transformers") if rnd % 2 == 0 else ("transformers", "engine")
            for side in sides:
                if side == "engine":
                    res = _spawn(_engine_rank, tp, 1, spec, common)
                else:
                    res = _spawn(_transformers_proc, 1, tp, spec, {**common, "threads": tp})
                row = pooled.setdefault((tp, side), {
                    "side": side, "label": f"engine TP{tp}" if side == "engine" else "transformers",
                    "tp": tp, "processes": tp if side == "engine" else 1,
                    "threads_per_process": 1 if side == "engine" else tp,
                    "times": {k: [] for k in res["times"]}, "tokens": res["tokens"]})
                for k, v in res["times"].items():
                    row["times"][k] += v
                row["tokens_stable"] = row.get("tokens_stable", True) and row["tokens"] == res["tokens"]
                row.update({k: v for k, v in res.items() if k not in ("times", "tokens")})
                print(f"  round {rnd + 1}/{args.rounds}: {row['label']} "
                      f"({tp} thread(s) in all) done", flush=True)
    rows = []
    for tp in args.tp:
        for side in ("engine", "transformers"):
            row = pooled[tp, side]
            rows.append({**row, **_rates(args, row["times"])})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, action="append", help="engine TP sizes (default 1 and 2)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers of the bench spec")
    ap.add_argument("--prefill-batch", type=int, default=1)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens before decoding")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens generated (N)")
    ap.add_argument("--rounds", type=int, default=3, help="fresh processes per side, alternating")
    ap.add_argument("--repeat", type=int, default=2, help="timed runs per process and number")
    ap.add_argument("--out", default="out/engine_forward.json", help="JSON results")
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode rate is measured between 1 and N tokens)")
    if args.rounds < 1 or args.repeat < 1:
        ap.error("--rounds and --repeat must be >= 1")
    args.tp = args.tp or [1, 2]
    spec = bench_spec(args.layers)
    print(f"model {spec.name}: {spec.num_parameters() / 1e6:.1f}M params, fp32, "
          f"hidden {spec.hidden_size}, heads {spec.num_heads}/{spec.num_kv_heads}, "
          f"vocab {spec.vocab_size}; torch {torch.__version__}")
    print(f"machine {_machine()}")
    print(f"prefill {args.prefill_batch}x{args.prefill_len} tokens; decode: prompt "
          f"{args.prompt_len}, {args.new_tokens} greedy tokens, rate (N-1)/(t(N)-t(1)); "
          f"fastest of {args.rounds} rounds x {args.repeat} runs (1 warm-up per process)")
    print("threads: engine TP t = t gloo processes x 1 torch thread; "
          "transformers beside it = 1 process x t torch threads (same cores in all)")
    rows = _run_rounds(spec, args)

    print(f"\n{'side':<14} {'procs x threads':>15} {'prefill tok/s':>14} {'decode tok/s':>13} "
          f"{'engine/hf prefill, decode':>26} {'greedy = hf':>12}")
    for tp in args.tp:
        eng, hf = (next(r for r in rows if r["tp"] == tp and r["side"] == s)
                   for s in ("engine", "transformers"))
        eng["prefill_vs_transformers"] = eng["prefill_tok_s"] / hf["prefill_tok_s"]
        eng["decode_vs_transformers"] = eng["decode_tok_s"] / hf["decode_tok_s"]
        eng["greedy_equal"] = eng["tokens"] == hf["tokens"]
        for r in (eng, hf):
            ratio = (f"{eng['prefill_vs_transformers']:.2f}x, {eng['decode_vs_transformers']:.2f}x"
                     if r is eng else "")
            same = ("yes" if eng["greedy_equal"] else "NO") if r is eng else ""
            print(f"{r['label']:<14} {r['processes']:>7} x {r['threads_per_process']:<5} "
                  f"{r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f} {ratio:>26} {same:>12}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": _machine(), "torch": torch.__version__, "spec": spec.name,
                   "params": spec.num_parameters(), "args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
