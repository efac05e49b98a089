#!/usr/bin/env python3
"""Recipes per model: the default topology, a local checkpoint, and the GRPO + sync loop.

    python examples/run.py list
    python examples/run.py prepare Qwen3-4B [--from-hf DIR] [--out DIR]
    python examples/run.py run Qwen3-4B --mode p2p|broadcast|delta [--nodes N --node-rank R --head-ip IP]

Without CUDA (``--size auto``) every recipe runs the tiny variant of its family on CPU
(Qwen3 -> tiny-qwen3, Llama -> tiny-llama, Qwen2.5 -> tiny-qwen2, Qwen3-MoE -> tiny-qwen3-moe,
GLM4-MoE -> tiny-glm4-moe, DeepSeek-V3 / Kimi-K2 -> tiny-deepseek-v3, GLM-4.7-Flash -> tiny-glm4-moe-lite,
GLM-5 / GLM-5-4layer -> tiny-glm5, DeepSeek-V3.2 -> tiny-deepseek-v32, Qwen3-Next-80B-A3B -> tiny-qwen3-next:
planned and listed, not runnable on CPU yet: the reference models have no gated DeltaNet forward)
with a CPU-sized topology.
Environment knobs: ``SHARDSYNC_BUCKET_MB`` (bucket size, MiB) and ``SHARDSYNC_SKIP_VERIFY=1``
(skip the bitwise checksum after each update).  See docs/examples.md and docs/ray.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Topo:
    trainer_tp: int
    trainer_pp: int
    engine_tp: tuple[int, ...]
    trainer_dp: int = 1
    trainer_ep: int = 1  # mixture of experts: expert parallel, expert TP (None: trainer TP)
    trainer_etp: int | None = None
    engine_ep: int = 1
    pp_layers: tuple[int, ...] | None = None

    @property
    def devices(self) -> int:
        return self.trainer_tp * self.trainer_pp * self.trainer_dp + sum(self.engine_tp)

    def trainer(self):
        from shardsync.layout import MegatronParallel

        return MegatronParallel(tp=self.trainer_tp, pp=self.trainer_pp, dp=self.trainer_dp, ep=self.trainer_ep,
                                etp=self.trainer_etp, pp_layers=self.pp_layers, dtype="float32")

    def __str__(self) -> str:
        pp = f" PP{self.trainer_pp}" if self.trainer_pp > 1 else ""
        dp = f" DP{self.trainer_dp}" if self.trainer_dp > 1 else ""
        ep = f" EP{self.trainer_ep} ETP{self.trainer_etp or self.trainer_tp}" if self.trainer_ep > 1 else ""
        eep = f" EP{self.engine_ep}" if self.engine_ep > 1 else ""
        engines = f"{len(self.engine_tp)} engine(s) TP {list(self.engine_tp)}{eep}"
        return f"trainer TP{self.trainer_tp}{pp}{dp}{ep} -> {engines}"


@dataclass(frozen=True)
class Recipe:
    """A model's default topology on GPU nodes and the CPU-sized one of its tiny variant."""

    model: str
    tiny: str
    gpu: Topo
    cpu: Topo

    @property
    def nodes(self) -> int:
        return math.ceil(self.gpu.devices / GPUS_PER_NODE)


RECIPES = {r.model: r for r in (
    Recipe("Qwen3-4B", "tiny-qwen3", Topo(4, 1, (4,)), Topo(2, 1, (2,))),
    Recipe("Qwen3-8B", "tiny-qwen3", Topo(4, 1, (4,)), Topo(2, 1, (2,))),
    Recipe("Llama-3.1-8B", "tiny-llama", Topo(4, 1, (2, 2)), Topo(2, 1, (1, 1))),
    Recipe("Qwen2.5-7B", "tiny-qwen2", Topo(4, 1, (4,)), Topo(2, 1, (2,))),
    Recipe("Qwen3-32B", "tiny-qwen3", Topo(8, 2, (4, 4, 4, 4)), Topo(2, 2, (2,))),
    Recipe("Llama-3.1-70B", "tiny-llama", Topo(8, 4, (8, 8, 8, 8)), Topo(2, 2, (2, 2))),
    # mixture of experts: experts over the trainer's DP ranks (ETP 1), engines EP = TP
    Recipe("Qwen3-30B-A3B", "tiny-qwen3-moe", Topo(4, 1, (8,), trainer_dp=2, trainer_ep=8, trainer_etp=1, engine_ep=8),
           Topo(1, 1, (2,), trainer_dp=2, trainer_ep=2, engine_ep=2)),
    Recipe("Qwen3-235B-A22B", "tiny-qwen3-moe",
           Topo(4, 4, (8, 8), trainer_dp=2, trainer_ep=8, trainer_etp=1, engine_ep=8, pp_layers=(24, 24, 24, 22)),
           Topo(1, 2, (2,), trainer_dp=2, trainer_ep=2, engine_ep=2)),
    Recipe("GLM-4.5-Air", "tiny-glm4-moe", Topo(4, 2, (8, 8), trainer_dp=2, trainer_ep=8, trainer_etp=1, engine_ep=8),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    # multi-head latent attention.  DeepSeek-V3: NeMo-RL's PP16 x EP16 -> TP32 x DP8 (64 nodes);
    # Kimi-K2: the P2P examples' 64-node run (32 trainer + 32 rollout nodes); GLM-4.7-Flash: TP4 EP8 -> TP4 EP4
    Recipe("DeepSeek-V3", "tiny-deepseek-v3",
           Topo(1, 16, (32,) * 8, trainer_dp=16, trainer_ep=16, trainer_etp=1, engine_ep=32,
                pp_layers=(4,) * 15 + (1,)),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    Recipe("Kimi-K2", "tiny-deepseek-v3",
           Topo(8, 4, (16,) * 16, trainer_dp=8, trainer_ep=32, trainer_etp=1, engine_ep=16, pp_layers=(16, 15, 15, 15)),
           Topo(1, 2, (2,), trainer_dp=2, trainer_ep=2, engine_ep=2)),
    Recipe("GLM-4.7-Flash", "tiny-glm4-moe-lite",
           Topo(4, 1, (4,), trainer_dp=2, trainer_ep=8, trainer_etp=1, engine_ep=4),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    # sparse attention.  GLM-5: the examples' 16 + 16 nodes, trainer TP4 PP4 EP32 (CP 2 counted as DP: it holds the
    # same weights), last stage 18 layers; engines one per node TP8 EP8 (the examples' SGLang runs DP attention with
    # EP 64, a layout the engine tables do not hold yet).  GLM-5-4layer: their one-node run, TP4 EP8 -> TP8 EP8
    Recipe("GLM-5", "tiny-glm5",
           Topo(4, 4, (8,) * 16, trainer_dp=8, trainer_ep=32, trainer_etp=1, engine_ep=8, pp_layers=(20, 20, 20, 18)),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    Recipe("GLM-5-4layer", "tiny-glm5",
           Topo(4, 1, (8,), trainer_dp=2, trainer_ep=8, trainer_etp=1, engine_ep=8),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    # gated DeltaNet hybrid: the trainer on one node, TP2 EP8 (DP 4) ->
    # two engines TP4 EP4 (the linear-attention heads split by whole key-head groups)
    Recipe("Qwen3-Next-80B-A3B", "tiny-qwen3-next",
           Topo(2, 1, (4, 4), trainer_dp=4, trainer_ep=8, trainer_etp=1, engine_ep=4),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
    Recipe("DeepSeek-V3.2", "tiny-deepseek-v32",
           Topo(1, 16, (32,) * 8, trainer_dp=16, trainer_ep=16, trainer_etp=1, engine_ep=32,
                pp_layers=(4,) * 15 + (1,)),
           Topo(2, 1, (2,), trainer_ep=2, trainer_etp=1, engine_ep=2)),
)}


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise SystemExit(f"error: no recipe for {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[name]


def _tiny(size: str) -> bool:
    if size == "auto":
        import torch

        return not torch.cuda.is_available()
    return size == "tiny"


def _env_bucket_mb(default: float) -> float:
    value = os.environ.get("SHARDSYNC_BUCKET_MB")
    if not value:
        return default
    try:
        mb = float(value)
    except ValueError:
        raise SystemExit(f"error: SHARDSYNC_BUCKET_MB={value!r} is not a number of MiB") from None
    if mb <= 0:
        raise SystemExit(f"error: SHARDSYNC_BUCKET_MB must be positive, got {value}")
    return mb


def _skip_verify() -> bool:
    return os.environ.get("SHARDSYNC_SKIP_VERIFY", "") not in ("", "0", "false", "no")


# -- list ------------------------------------------------------------------------------------

def cmd_list(args: argparse.Namespace) -> int:
    from shardsync.presets import PRESETS

    rows = [{"model": r.model, "params_b": round(PRESETS[r.model].num_parameters() / 1e9, 2),
             "nodes": r.nodes, "gpus": r.gpu.devices, **{f"gpu_{k}": v for k, v in asdict(r.gpu).items()},
             "tiny": r.tiny, **{f"cpu_{k}": v for k, v in asdict(r.cpu).items()}}
            for r in RECIPES.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':<14} {'params':>7} {'nodes x GPUs':>12}  {'default topology':<48} CPU (no CUDA)")
    for r in RECIPES.values():
        print(f"{r.model:<14} {PRESETS[r.model].num_parameters() / 1e9:>6.1f}B "
              f"{r.nodes:>5} x {GPUS_PER_NODE:<4}  {str(r.gpu):<48} {r.tiny}: {r.cpu}")
    return 0


# -- prepare ---------------------------------------------------------------------------------

def _hf_names(root: Path) -> list[str]:
    from safetensors import safe_open

    index = root / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            names.extend(h.keys())
    if not names:
        raise SystemExit(f"error: {root} holds no *.safetensors; pass a HuggingFace checkpoint directory")
    return names


def _shards(spec, limit_bytes: int) -> list[list[str]]:
    """Logical tensor names grouped in checkpoint order into files of at most ``limit_bytes``
    (a single tensor larger than that gets a file of its own)."""
    import torch

    from shardsync.layout import logical_tensors

    item = torch.empty((), dtype=getattr(torch, spec.dtype)).element_size()
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in logical_tensors(spec).items():
        n = math.prod(shape) * item
        if groups[-1] and size + n > limit_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def write_checkpoint(spec, source, out: Path, *, shard_mb: float) -> list[str]:
    """config.json plus safetensors (sharded with an index when over ``shard_mb``)."""
    import torch
    from safetensors.torch import save_file

    groups = _shards(spec, int(shard_mb * 2**20))
    dtype = getattr(torch, spec.dtype)
    files = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    weight_map, total = {}, 0
    for file, names in zip(files, groups, strict=True):
        tensors = {n: source(n).to(dtype).contiguous() for n in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return files


def megatron_layout_json(spec, topo: Topo, source: str) -> dict:
    """Every trainer rank's Megatron-core local tensors and the HF boxes they hold."""
    from shardsync.layout import megatron_layout

    par = topo.trainer()
    lay = megatron_layout(spec, par)
    ranks = []
    for i, rl in enumerate(lay.ranks):
        tensors = [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype,
                    "pieces": [{"logical": p.logical, "offsets": list(p.offsets), "sizes": list(p.sizes),
                                "local_offsets": list(p.local_offsets)} for p in rl.pieces_of(t.name)]}
                   for t in rl.tensors]
        ranks.append({"rank": i, "label": rl.label, "tensors": tensors})
    return {"model": spec.name, "source": source, "param_dtype": spec.dtype,
            "trainer": {"tp": par.tp, "pp": par.pp, "dp": par.dp, "ep": par.ep, "etp": par.expert_tp,
                        "make_vocab_size_divisible_by": par.make_vocab_size_divisible_by,
                        "norm_names": par.norm_names, "dtype": "float32"},
            "engines": list(topo.engine_tp), "ranks": ranks}


def cmd_prepare(args: argparse.Namespace) -> int:
    from shardsync.layout import logical_tensors
    from shardsync.models.weights import checkpoint_source, random_source
    from shardsync.presets import PRESETS, load_spec

    recipe = _recipe(args.model)
    tiny = _tiny(args.size)
    topo = recipe.cpu if tiny else recipe.gpu
    if args.from_hf:
        root = Path(args.from_hf)
        try:
            spec = load_spec(root)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        if spec.family != PRESETS[recipe.model].family:
            raise SystemExit(f"error: {root} is a {spec.family} model but {recipe.model} is "
                             f"{PRESETS[recipe.model].family}; pick the recipe of its family")
        names = set(_hf_names(root))
        wanted = logical_tensors(spec)
        missing = sorted(set(wanted) - names)
        if missing:
            raise SystemExit(f"error: {root} lacks {len(missing)} tensor(s) the model needs, e.g. "
                             f"{missing[:5]}; is it a complete {spec.family} checkpoint?")
        unused = sorted(names - set(wanted))
        if unused:
            print(f"ignoring {len(unused)} checkpoint tensor(s) the model does not use: {unused[:5]}")
        source, origin = checkpoint_source(root), f"hf:{root.resolve()}"
    else:
        spec = PRESETS[recipe.tiny if tiny else recipe.model]
        source, origin = random_source(spec, args.seed), f"random:seed={args.seed}"
    out = Path(args.out or f"out/checkpoints/{recipe.model}{'-tiny' if tiny else ''}")
    out.mkdir(parents=True, exist_ok=True)
    try:
        layout = megatron_layout_json(spec, topo, origin)
    except ValueError as e:
        raise SystemExit(f"error: {spec.name} does not fit {topo}: {e}") from None
    if args.from_hf:
        shutil.copyfile(Path(args.from_hf) / "config.json", out / "config.json")
    else:
        (out / "config.json").write_text(json.dumps(spec.to_hf_config(), indent=2))
    files = write_checkpoint(spec, source, out, shard_mb=args.shard_mb)
    (out / "megatron_layout.json").write_text(json.dumps(layout, indent=1))
    print(f"wrote {out}: config.json, {len(files)} safetensors file(s)"
          f"{' + model.safetensors.index.json' if len(files) > 1 else ''}, megatron_layout.json "
          f"({spec.name}, {spec.num_parameters() / 1e6:.1f} M params, {spec.dtype}; {origin}; "
          f"layout for {topo})")
    return 0


# -- run -------------------------------------------------------------------------------------

def _ray(*argv: str) -> list[str]:
    return [sys.executable, "-m", "ray.scripts.scripts", *argv]


def _delta_unsupported() -> str | None:
    """Why the installed runtime refuses ``mode="delta"``, or None when it accepts it."""
    from shardsync.config import DeltaConfig, SyncConfig

    try:
        SyncConfig(delta=DeltaConfig())
    except ValueError as e:
        return str(e)
    return None


def _config(args: argparse.Namespace, recipe: Recipe, tiny: bool):
    from shardsync.demo import DemoConfig

    topo = recipe.cpu if tiny else recipe.gpu
    model = args.checkpoint or (recipe.tiny if tiny else recipe.model)
    return DemoConfig(model=model, trainer_tp=topo.trainer_tp, trainer_pp=topo.trainer_pp,
                      trainer_dp=topo.trainer_dp, trainer_ep=topo.trainer_ep, trainer_etp=topo.trainer_etp,
                      trainer_pp_layers=topo.pp_layers if not tiny else None, engine_ep=topo.engine_ep,
                      engine_tp=topo.engine_tp, steps=args.steps, mode=args.mode,
                      bucket_mb=_env_bucket_mb(1.0 if tiny else 256.0), seed=args.seed,
                      out=args.out or f"out/examples/{recipe.model}", delta_transport=args.delta_transport)


def _check_checkpoint(args: argparse.Namespace, launcher: str, topo: Topo) -> None:
    from shardsync.presets import load_spec

    try:
        spec = load_spec(args.checkpoint)
    except ValueError as e:
        raise SystemExit(f"error: --checkpoint: {e}") from None
    if spec.num_kv_heads % topo.trainer_tp:
        raise SystemExit(f"error: {args.checkpoint} has {spec.num_kv_heads} KV heads, which trainer "
                         f"TP{topo.trainer_tp} does not divide; prepare and run with the same --size")
    meta = Path(args.checkpoint) / "megatron_layout.json"
    source = json.loads(meta.read_text())["source"] if meta.is_file() else "unknown"
    if launcher == "local" and source != f"random:seed={args.seed}":
        print(f"note: engines load {args.checkpoint} ({source}); the embedded launcher's trainer "
              f"starts from the preset's random weights (seed {args.seed}), so they agree only "
              "after the first update; --launcher ray loads the checkpoint on the trainer too")


def cmd_run(args: argparse.Namespace) -> int:
    recipe = _recipe(args.model)
    tiny = _tiny(args.size)
    if args.mode == "delta" and (why := _delta_unsupported()):
        print(f"error: --mode delta is not available in this shardsync runtime ({why}); "
              "use --mode p2p or --mode broadcast", file=sys.stderr)
        return 2
    if args.nodes > 1 and args.node_rank > 0:
        if not args.head_ip:
            raise SystemExit("error: --node-rank > 0 needs --head-ip (the address of node rank 0)")
        print(f"node {args.node_rank}/{args.nodes}: joining the Ray cluster at {args.head_ip}:{args.ray_port}")
        return subprocess.call(_ray("start", f"--address={args.head_ip}:{args.ray_port}", "--block"))
    launcher = "ray" if args.nodes > 1 else args.launcher
    cfg = _config(args, recipe, tiny)
    topo = recipe.cpu if tiny else recipe.gpu
    if args.checkpoint:
        _check_checkpoint(args, launcher, topo)
    print(f"{recipe.model} ({'tiny variant ' + recipe.tiny + ', CPU' if tiny else 'full size'}): {topo}, "
          f"mode {args.mode}, buckets {cfg.bucket_mb:g} MiB, launcher {launcher}, {args.nodes} node(s)")
    verify = not _skip_verify()
    if launcher == "local":
        import dataclasses

        from shardsync.demo import run_demo

        return run_demo(dataclasses.replace(cfg, verify=verify))
    from shardsync.launch import run_on_ray

    if args.nodes == 1:
        return run_on_ray(cfg, address=args.ray_address, verify=verify)
    return _run_head(cfg, args, verify)


def _run_head(cfg, args: argparse.Namespace, verify: bool) -> int:
    """Node rank 0: the Ray head as a child process (stopped by its pid at the end, never
    by ``ray stop``, which would end every Ray process of this user on the host), then the
    driver once ``--nodes`` nodes have joined."""
    from shardsync.launch import run_on_ray

    cmd = ["start", "--head", f"--port={args.ray_port}", "--include-dashboard=false", "--block"]
    if args.head_ip:
        cmd.append(f"--node-ip-address={args.head_ip}")
    head = subprocess.Popen(_ray(*cmd))
    try:
        deadline = time.monotonic() + 120
        while True:
            if head.poll() is not None:
                print(f"error: ray start --head exited with {head.returncode} (see above)", file=sys.stderr)
                return 1
            try:
                socket.create_connection((args.head_ip or "127.0.0.1", args.ray_port), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    print("error: the Ray head did not come up in 120 s", file=sys.stderr)
                    return 1
                time.sleep(1)
        time.sleep(2)  # the head registers its address for "auto" right after the GCS listens
        # "auto": the cluster just started here, with the auth mode `ray start` chose
        return run_on_ray(cfg, address="auto", min_nodes=args.nodes, verify=verify)
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="examples/run.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="models and their default topologies")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    size = {"default": "auto", "choices": ["auto", "tiny", "full"],
            "help": "tiny: the family's CPU variant; auto: tiny unless CUDA is available"}
    p = sub.add_parser("prepare", help="write a local checkpoint dir and its Megatron layout")
    p.add_argument("model", help=f"one of {', '.join(RECIPES)}")
    p.add_argument("--size", **size)
    p.add_argument("--from-hf", default=None, help="convert this local HF checkpoint dir instead")
    p.add_argument("--out", default=None, help="default: out/checkpoints/MODEL[-tiny]")
    p.add_argument("--seed", type=int, default=0, help="random weights seed (same as the engines')")
    p.add_argument("--shard-mb", type=float, default=4096, help="split safetensors files above this")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("run", help="GRPO steps with a weight sync after each, on this model's topology")
    p.add_argument("model", help=f"one of {', '.join(RECIPES)}")
    p.add_argument("--mode", default="p2p", choices=["p2p", "broadcast", "delta", "both"])
    p.add_argument("--delta-transport", default="p2p", choices=["p2p", "broadcast", "disk"])
    p.add_argument("--size", **size)
    p.add_argument("--checkpoint", default=None, help="a `prepare` output dir (default: the preset)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default: out/examples/MODEL")
    p.add_argument("--launcher", default="local", choices=["local", "ray"],
                   help="one node: local processes (default) or Ray actors; several nodes: Ray")
    p.add_argument("--ray-address", default=None, help="one node, --launcher ray: a running cluster")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--head-ip", default=None, help="node rank 0's address (the Ray head)")
    p.add_argument("--ray-port", type=int, default=6379)
    p.set_defaults(func=cmd_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
