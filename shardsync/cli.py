"""shardsync: shard-level weight sync from a Megatron-style trainer into rollout engines.

Plan what a sync moves (``plan``), watch it run end to end (``demo``: GRPO steps between a
reference trainer and engine servers), measure transports on this machine (``bench``), or
serve the reference rollout engine (``engine serve``), draw one update per bucket
(``timeline``).  ``shardsync COMMAND --help`` for each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import asdict

from shardsync.layout import EngineParallel, Fsdp2Parallel, MegatronParallel
from shardsync.lora.flags import add_lora_args, lora_of
from shardsync.presets import load_spec
from shardsync.quant.fp8 import FORMATS
from shardsync.topology import Topology
from shardsync.units import fmt_bytes
from shardsync.views import Host, views_of


def _engine_tps(value: str, engines: int) -> tuple[int, ...]:
    tps = tuple(int(x) for x in value.split(","))
    if len(tps) == 1:
        return tps * engines
    if engines not in (1, len(tps)):
        raise SystemExit(f"--engine-tp lists {len(tps)} engines but --engines is {engines}")
    return tps


def _ints(value: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in value.split(",")) if value else None


def cmd_plan(args: argparse.Namespace) -> int:
    from shardsync.plan.summary import summarize
    from shardsync.progress import Progress

    if args.matrix:
        from shardsync.plan.matrix import render_markdown

        print(render_markdown(), end="")
        return 0
    spec = load_spec(args.model, dtype=args.dtype)
    try:
        trainer: MegatronParallel | Fsdp2Parallel
        if args.trainer == "fsdp2":  # --trainer-dp ranks shard every tensor; --trainer-replicate copies (HSDP)
            trainer = Fsdp2Parallel(shard=args.trainer_dp, replicate=args.trainer_replicate)
        else:
            trainer = MegatronParallel(tp=args.trainer_tp, pp=args.trainer_pp, dp=args.trainer_dp, ep=args.trainer_ep,
                                       etp=args.trainer_etp, pp_layers=_ints(args.trainer_pp_layers),
                                       expert_names=args.expert_names,
                                       make_vocab_size_divisible_by=args.vocab_divisible_by)
        engines = tuple(EngineParallel(tp=t, ep=args.engine_ep) for t in _engine_tps(args.engine_tp, args.engines))
        topo = Topology(spec, trainer, engines, views=views_of(args.engine_quantization, lora_of(args)),
                        host=Host(args.engine_kind))
        t0 = time.perf_counter()
        report = summarize(topo, int(args.bucket_mb * 2**20), progress=Progress(f"planning {spec.name}"))
        report["plan_s"] = round(time.perf_counter() - t0, 3)
        if args.fabric:
            from shardsync.plan.fabric import fabric, lower_bounds
            from shardsync.plan.tuning import recommend

            f = fabric(args.fabric)
            bounds = lower_bounds(topo, f, int(args.bucket_mb * 2**20))
            report["fabric"] = {"name": f.name, "description": f.description,
                                "paths": [b for b in bounds if b["path"] == "broadcast" or report["p2p_ok"]]}
            memory = None if args.bucket_memory_mb is None else int(args.bucket_memory_mb * 2**20)
            report["recommended_bucket"] = {
                p["path"]: asdict(recommend(p["busiest_link_bytes"], f, memory_bytes=memory))
                for p in report["paths"]}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if isinstance(trainer, Fsdp2Parallel):
        desc = f"FSDP2 shard {trainer.shard}" + (f" x replicate {trainer.replicate}" if trainer.replicate > 1 else "")
    else:
        experts = f" EP{trainer.ep} ETP{trainer.expert_tp}" if spec.is_moe else ""
        desc = f"TP{trainer.tp} PP{trainer.pp} DP{trainer.dp}{experts}"
    engine_ep = f" EP{args.engine_ep}" if spec.is_moe else ""
    served = "" if args.engine_quantization is None else f" serving {args.engine_quantization}"
    print(f"model {spec.name} ({spec.num_parameters() / 1e9:.3f} B params, {spec.dtype}); trainer "
          f"{desc} -> engines TP {list(report['engines'])}{engine_ep}{served}; "
          f"buckets of {args.bucket_mb:g} MiB; planned in {report['plan_s']:.2f} s")
    views = topo.summary()
    if views is not None:
        print(views)
    head = f"{'path':<10} {'total':>12} {'per receiver':>13} {'busiest link':>13} {'buckets':>8} {'copies':>8}  busiest"
    print(head)
    for p in report["paths"]:
        print(f"{p['path']:<10} {fmt_bytes(p['total_bytes']):>12} {fmt_bytes(p['per_receiver_bytes']):>13} "
              f"{fmt_bytes(p['busiest_link_bytes']):>13} {p['buckets']:>8} {p['copies']:>8}  {p['busiest_link']}")
    paths = {p["path"]: p for p in report["paths"]}
    if "p2p" in paths:
        ratio = paths["p2p"]["busiest_link_bytes"] / paths["broadcast"]["per_receiver_bytes"]
        print(f"busiest p2p link / broadcast bytes per receiver = {ratio:.4f}")
    print("p2p preconditions:")
    for v in report["p2p_preconditions"]:
        mark = "ok  " if v["ok"] else "FAIL"
        print(f"  [{mark}] {v['name']:<20} {v['detail']}")
    print("p2p: " + ("available" if report["p2p_ok"] else "not available, mode=auto uses broadcast"))
    if "fabric" in report:
        fab = report["fabric"]
        print(f"lower bounds on {fab['name']} ({fab['description']}; trainer and engines on separate nodes):")
        for b in fab["paths"]:
            print(f"  {b['path']:<10} >= {b['lower_bound_s'] * 1e3:9.1f} ms   bound by {b['binds']}; "
                  f"{b['links']} links, {b['buckets']} buckets")
        print(f"recommended bucket size on {fab['name']} (docs/tuning.md):")
        for path, a in report["recommended_bucket"].items():
            print(f"  {path:<10} --bucket-mb {a['bucket_bytes'] >> 20:<5} {a['messages']} messages on the busiest "
                  f"link cost {a['message_s'] * 1e3:.2f} ms, the pipeline's fill {a['fill_s'] * 1e3:.2f} ms "
                  f"({a['why']})")
    return 0


def _staging_bytes(text: str) -> int:
    from shardsync.engine.worker import SHARD

    if text == "shard":
        return SHARD
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("--staging-bytes takes 0, a byte count or 'shard'")
    return value


def cmd_engine_serve(args: argparse.Namespace) -> int:
    _require_engine_extra()
    from shardsync.engine.launch import EngineConfig, serve

    return serve(EngineConfig(model=args.model, tp=args.tp, ep=args.ep, host=args.host, port=args.port,
                              seed=args.seed, dtype=args.dtype, device=args.device,
                              threads=args.threads, log_level=args.log_level, advertise=args.advertise,
                              token_file=args.token_file, delta_root=args.delta_root,
                              staging_bytes=args.staging_bytes, crossing=args.crossing,
                              commit_wait_s=args.commit_wait_s, quantization=args.quantization,
                              lora=lora_of(args), lora_merge=args.lora_merge, listen_fd=args.listen_fd))


ENGINE_EXTRA = ("fastapi", "uvicorn")  # the reference engine's server (pyproject's ``engine`` extra)


def _require_engine_extra() -> None:
    """Refuse, in one line, before any process is spawned, when the reference engine's server
    cannot start (a plain ``pip install shardsync``)."""
    missing = [m for m in ENGINE_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"the reference engine needs {', '.join(missing)}: install the engine extra, "
                       "pip install 'shardsync[engine]'")


class CliError(Exception):
    """A command line that cannot run: printed as one line, exit status 2."""


def cmd_demo(args: argparse.Namespace) -> int:
    if args.engine == "reference":
        _require_engine_extra()
    from shardsync.demo import DemoConfig, run_demo

    tps = _engine_tps(args.engine_tp or ("1" if args.engine == "vllm" else "2"), args.engines)
    trainer_tp = args.trainer_tp if args.trainer_tp is not None else (1 if args.trainer == "fsdp2" else 2)
    cfg = DemoConfig(model=args.model, trainer_tp=trainer_tp, trainer_pp=args.trainer_pp,
                     trainer_dp=args.trainer_dp, trainer_ep=args.trainer_ep, trainer_etp=args.trainer_etp,
                     trainer_kind=args.trainer,
                     engine_ep=args.engine_ep, engine_tp=tps, steps=args.steps, mode=args.mode,
                     bucket_mb=args.bucket_mb,
                     seed=args.seed, lr=args.lr, out=args.out, delta_transport=args.delta_transport,
                     engine_dtype=args.engine_dtype, device=args.device, ipc=args.ipc, engine=args.engine,
                     staging=args.staging, engine_quantization=args.engine_quantization, lora_rank=args.lora)
    if args.launcher == "ray" and args.engine == "vllm":
        print("error: --engine vllm runs with the local launcher only", file=sys.stderr)
        return 2
    if args.launcher == "ray":  # trainer ranks and engines as Ray actors (docs/ray.md)
        from shardsync.launch import run_on_ray

        return run_on_ray(cfg, address=args.ray_address)
    return run_demo(cfg)


def cmd_bench(args: argparse.Namespace) -> int:
    from shardsync.bench.args import config_from_args
    from shardsync.bench.run import main as run_bench

    try:
        return run_bench(config_from_args(args))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_timeline(args: argparse.Namespace) -> int:
    from shardsync.timeline import render

    try:
        items = render(args.records, version=args.version, png=args.png, trace=args.trace)
    except ValueError as e:
        raise SystemExit(f"shardsync timeline: {e}") from None
    rows = sorted({s.row for s in items})
    print(f"{len(items)} spans over {', '.join(rows)}; wrote {args.png} and {args.trace}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardsync", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.ArgumentDefaultsHelpFormatter  # every flag's help ends with its default

    p = sub.add_parser("plan", help="print what a sync moves, per path, and whether p2p applies",
                       description="What a sync of a model between a trainer and engines moves, per path "
                                   "(p2p, broadcast), from metadata only; whether p2p's preconditions hold.",
                       formatter_class=fmt)
    p.add_argument("--model", default="Qwen3-4B", help="preset name or path to config.json")
    p.add_argument("--trainer-tp", type=int, default=1, help="trainer tensor parallel size")
    p.add_argument("--trainer-pp", type=int, default=1, help="trainer pipeline stages")
    p.add_argument("--trainer", default="megatron", choices=["megatron", "fsdp2"],
                   help="trainer layout: Megatron-core, or FSDP2 (--trainer-dp ranks shard every tensor)")
    p.add_argument("--trainer-dp", type=int, default=1,
                   help="trainer data parallel size (fsdp2: the ranks sharding every tensor)")
    p.add_argument("--trainer-replicate", type=int, default=1, help="fsdp2: HSDP copies of the shard group")
    p.add_argument("--trainer-pp-layers", default=None, help="uneven stages: layers per stage, comma list")
    p.add_argument("--trainer-ep", type=int, default=1, help="expert parallel (MoE)")
    p.add_argument("--trainer-etp", type=int, default=None, help="expert tensor parallel (default: trainer TP)")
    p.add_argument("--expert-names", default="sequential", choices=["sequential", "grouped"],
                   help="Megatron expert spelling: SequentialMLP local_experts.{j} or TE grouped weight{j}")
    p.add_argument("--engine-tp", default="1", help="engine TP, or a comma list (one per engine)")
    p.add_argument("--engine-ep", type=int, default=1, help="engine expert parallel within its TP group (MoE)")
    p.add_argument("--engines", type=int, default=1, help="engines of --engine-tp each")
    p.add_argument("--engine-kind", default="reference", help="reference, sglang or vllm")
    p.add_argument("--bucket-mb", type=float, default=512, help="bucket size in MiB")
    p.add_argument("--vocab-divisible-by", type=int, default=128,
                   help="Megatron's make_vocab_size_divisible_by (the trainer's vocab padding)")
    p.add_argument("--dtype", default=None, help="override the model dtype (wire dtype)")
    p.add_argument("--engine-quantization", default=None,
                   help="the engines serve FP8 in this format (quant.FORMATS, e.g. fp8): the plans carry the "
                        "weights the trainer quantizes as e4m3 bytes and scales")
    add_lora_args(p, "plan the sync of a LoRA adapter of this rank alone (the base never moves)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--bucket-memory-mb", type=float, default=None,
                   help="with --fabric: buffer memory the recommended bucket size must fit (2 in flight)")
    p.add_argument("--fabric", default=None, choices=["nvlink4", "ib400", "8x400g", "pcie5", "cpu-gloo"],
                   help="print each path's lower-bound time on this named fabric (docs/fabric.md)")
    p.add_argument("--matrix", action="store_true",
                   help="print the fallback matrix (every topology x mode -> path and why) as markdown")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("demo", help="GRPO steps between a reference trainer and engine servers",
                       description="GRPO on a verifiable task between reference trainer ranks and engine "
                                   "servers on this machine, syncing the weights after every step and "
                                   "checking them bitwise; writes records, steps and a plot under --out.",
                       formatter_class=fmt)
    p.add_argument("--model", default="tiny-qwen3", help="preset name or path to config.json (CPU-sized: tiny-*)")
    p.add_argument("--trainer-tp", type=int, default=None, help="trainer tensor parallel size; None: 2 "
                                                                 "(1 with --trainer fsdp2)")
    p.add_argument("--trainer-pp", type=int, default=1, help="trainer pipeline stages")
    p.add_argument("--trainer", default="megatron", choices=["megatron", "fsdp2"],
                   help="the reference Megatron-layout trainer, or a transformers model under FSDP2 fully_shard")
    p.add_argument("--trainer-dp", type=int, default=1, help="trainer data parallel size")
    p.add_argument("--trainer-ep", type=int, default=1, help="expert parallel (MoE models)")
    p.add_argument("--trainer-etp", type=int, default=None, help="expert tensor parallel; None: the trainer TP")
    p.add_argument("--engine-ep", type=int, default=1, help="engine expert parallel within its TP group (MoE)")
    p.add_argument("--engine-tp", default=None,
                   help="engine TP, or a comma list (one per engine); None: 2 (vLLM: 1)")
    p.add_argument("--engines", type=int, default=1, help="engines of --engine-tp each")
    p.add_argument("--steps", type=int, default=5, help="GRPO steps (one weight update per mode after each)")
    p.add_argument("--mode", default="both", choices=["both", "auto", "p2p", "broadcast", "delta"],
                   help="how each step's weights reach the engines: both (p2p, then broadcast), auto (p2p "
                        "where its preconditions hold), p2p, broadcast, or delta (changed elements only)")
    p.add_argument("--delta-transport", default="p2p", choices=["p2p", "broadcast", "disk"],
                   help="--mode delta: how the changed elements travel")
    p.add_argument("--engine-dtype", default=None, help="engine weights dtype; None: the model's (delta: bfloat16)")
    p.add_argument("--engine-quantization", default=None, choices=sorted(FORMATS),
                   help="reference engines serve FP8 weights in this format (fp8: 128 x 128 blocks, float32 "
                        "scales; the trainer quantizes what it sends); the table's |lp diff| is then the "
                        "trainer/FP8-engine gap (a model whose engine shards are whole blocks: tiny-qwen3-fp8)"),
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket size in MiB")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="train a LoRA adapter of rank R on every linear (alpha 2R, frozen base) and sync the "
                        "adapter alone into engines serving it on their base")
    p.add_argument("--lr", type=float, default=None, help="learning rate; None: 1e-2 (1e-5 with --mode delta)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    p.add_argument("--out", default="out/demo", help="directory for records.jsonl, steps.json and demo.png")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: trainer ranks and engines share the GPU(s); p2p reads the "
                        "trainer's weights in place over CUDA IPC")
    p.add_argument("--ipc", action=argparse.BooleanOptionalAction, default=None,
                   help="engines read the trainer's tensors in place (CUDA IPC / shared memory); "
                        "default: on with --device cuda")
    p.add_argument("--staging", action=argparse.BooleanOptionalAction, default=True,
                   help="reference engines receive into staging while serving and pause only to commit "
                        "(--no-staging: in place, the whole receive pauses them)")
    p.add_argument("--engine", default="reference", choices=["reference", "vllm"],
                   help="reference: shardsync's engine server; vllm: real vLLM servers with the shardsync "
                        "backend (bash scripts/setup_vllm.sh; docs/vllm.md)")
    p.add_argument("--launcher", default="local", choices=["local", "ray"],
                   help="local: processes on this machine; ray: actors placed by Ray (docs/ray.md)")
    p.add_argument("--ray-address", default=None,
                   help="with --launcher ray: 'auto' or HOST:PORT of a running cluster (default: start a local one)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="sweep transports and engine-wave policies on this hardware",
                       formatter_class=fmt)
    from shardsync.bench.args import add_arguments as add_bench_arguments

    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("timeline", help="draw one update per bucket and rank (PNG and Chrome trace)",
                       description="Every trainer rank's buckets (pack, transfer, unpack) and each engine's "
                                   "receive and pause on one clock, from records written with "
                                   "SyncConfig(detail=True, records_path='records-{rank}.jsonl').")
    p.add_argument("records", nargs="+", help="the ranks' records files (JSON lines)")
    p.add_argument("--version", type=int, default=None, help="the update to draw (default: the newest in all)")
    p.add_argument("--png", default="timeline.png", help="the Gantt chart (PNG)")
    p.add_argument("--trace", default="timeline.json", help="Chrome trace JSON (chrome://tracing, Perfetto)")
    p.set_defaults(func=cmd_timeline)

    eng = sub.add_parser("engine", help="the reference rollout engine")
    esub = eng.add_subparsers(dest="engine_command", required=True, metavar="COMMAND")
    p = esub.add_parser("serve", help="start TP workers and the HTTP server on the first",
                        description="The reference rollout engine: TP worker processes and an HTTP server "
                                    "(generation, weight updates) on the first.", formatter_class=fmt)
    p.add_argument("--model", required=True, help="preset, config.json or HF checkpoint directory")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel workers")
    p.add_argument("--ep", type=int, default=1, help="expert parallel within the TP group (MoE models)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on (non-loopback needs a given secret)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--listen-fd", type=int, default=None, metavar="FD",
                   help="serve on this inherited listening socket (bound to --host/--port by a launcher)")
    p.add_argument("--seed", type=int, default=0, help="random weights seed (presets/configs)")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the model's)")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda (TP workers on GPUs 0..tp-1) or cuda:K (on GPUs K..K+tp-1, wrapping)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--log-level", default="warning", help="debug, info, warning or error")
    p.add_argument("--advertise", default=None, metavar="kind=K,pp=N,quantization=Q",
                   help="test stand-in: report these engine facts at connect instead of the reference "
                        "engine's (exercises the trainer's fallbacks for engines that cannot run here)")
    p.add_argument("--token-file", default=None,
                   help="file holding the secret shared with the trainer (default: $SHARDSYNC_TOKEN, "
                        "$SHARDSYNC_TOKEN_FILE, else this user's own secret file, made on first use); "
                        "a given secret is required to serve on a non-loopback host")
    p.add_argument("--delta-root", default=None,
                   help="directory disk deltas may be pulled from (pulls elsewhere are refused)")
    p.add_argument("--quantization", default=None, choices=sorted(FORMATS),
                   help="serve FP8 weights in this format (fp8: 128 x 128 blocks, float32 scales): the "
                        "linear weights are held in e4m3 with their scales, and each worker quantizes "
                        "what a sync delivers")
    add_lora_args(p, "serve a LoRA adapter of this rank on the base (zeroed until a sync writes it); a sync "
                     "then moves the adapter alone")
    p.add_argument("--lora-merge", action="store_true",
                   help="with --lora-rank: serve the adapter merged into the base (no LoRA kernel): each sync "
                        "moves A and B only and every worker merges base + scale * B @ A into its shard")
    p.add_argument("--staging-bytes", type=_staging_bytes, default=0, metavar="N|shard",
                   help="memory per TP worker to receive the next version into while serving; 0 (default): "
                        "receive in place, generation pauses for the whole receive; 'shard': one copy of the "
                        "worker's shard, generation pauses only for the commit; fewer bytes: a window of "
                        "the tensors received first is staged, generation pauses for the rest (received in "
                        "place) and the commit")
    p.add_argument("--crossing", choices=("finish", "span", "abort"), default="finish",
                   help="requests running when the weights change: finish on the old version (the change "
                        "waits, bounded by --commit-wait-s), span both (re-prefilled, spans in the response) "
                        "or abort (retryable error)")
    p.add_argument("--commit-wait-s", type=float, default=30.0,
                   help="finish: how long a weight change waits for running requests before aborting them")
    p.set_defaults(func=cmd_engine_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status 2 and one line on stderr for what the user can fix (a bad value, a missing
    extra); a traceback only for what they cannot."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CliError, ValueError) as e:
        print(f"shardsync: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
