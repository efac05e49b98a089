"""Adapter sync vs full sync, side by side in one run: for one model, an engine server and trainer
ranks (Megatron layout, fp32 masters) sync the whole model; then LoRA adapters of each rank,
alone, into an engine serving them with a LoRA term, and into one that merges them into its
base (``--lora-merge``: no LoRA kernel, base + scale * B @ A served).  Every engine stages whole
shards, so the pause is the swap (the merge runs before it, as ``derive``).  Reports per case
the median update time, the bytes moved, the engine's pause and merge time, checksums.

``--engine vllm`` (in vLLM's virtualenv, scripts/setup_vllm.sh) runs the same cases into real
vLLM servers instead: the whole model into one without LoRA, each adapter into one serving it
(``--enable-lora``; it takes the adapter whole, by broadcast, and reloads it from the adapter
directory the commit replaced); vLLM has no merge path.

    python benchmarks/lora_update.py --model Qwen2.5-0.5B --rank 8 --rank 64 --updates 5
    python benchmarks/lora_update.py --engine vllm --model Qwen2.5-0.5B --rank 8 --rank 64 --updates 5
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from shardsync.control.client import wait_healthy
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.launch.procs import run_ranks
from shardsync.lora import Lora
from shardsync.store.rendezvous import free_port
from shardsync.views import views_of

# (case name, LoRA rank or 0 for the whole model, merged into the base)
Case = tuple[str, int, bool]
VLLM_TOKEN = "lora-bench-token-0123456789abcdef"  # vLLM's workers read it from $SHARDSYNC_TOKEN


def _engine(model: str, args: argparse.Namespace, lora: Lora | None, merge: bool,
            root: str) -> tuple[subprocess.Popen, str]:
    if args.engine == "vllm":
        return _vllm(model, args, lora, root)
    proc, url = spawn_server(EngineConfig(model=model, tp=args.engine_tp, port=free_port(), staging_bytes=-1,
                                          lora=lora, lora_merge=merge))
    wait_healthy(url, proc, 900)
    return proc, url


def _vllm(model: str, args: argparse.Namespace, lora: Lora | None, root: str) -> tuple[subprocess.Popen, str]:
    """A vLLM server on a checkpoint of the trainer's start (and the adapter's, in its directory),
    both written under ``root``."""
    from shardsync.engines.vllm import serve
    from shardsync.lora import adapter_tensors
    from shardsync.models.checkpoint import write_checkpoint
    from shardsync.models.weights import random_source
    from shardsync.presets import load_spec
    from shardsync.receiver import peft_dir

    spec = load_spec(model)
    ckpt = write_checkpoint(spec, random_source(spec, 0), os.path.join(root, "ckpt"))
    module = None
    if lora is not None:
        source = random_source(spec, 0, shapes=adapter_tensors(spec, lora))
        peft_dir.write_dir(os.path.join(root, "adapter"), lora, {n: source(n) for n in adapter_tensors(spec, lora)})
        module = serve.LoraModule("policy", os.path.join(root, "adapter"), lora.rank)
    return serve.start(serve.VllmServer(str(ckpt), tp=args.engine_tp, lora=module, max_model_len=256,
                                        env={"SHARDSYNC_TOKEN": VLLM_TOKEN}), timeout_s=900)


def _trainer(rank: int, world: int, port: int, url: str, args: argparse.Namespace, lora: Lora | None, out) -> None:
    from shardsync.config import ControlConfig, SyncConfig, TransportConfig
    from shardsync.layout import MegatronParallel
    from shardsync.lora import adapter_tensors
    from shardsync.models.weights import load_rank, random_source
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    spec = load_spec(args.model)
    par = MegatronParallel(tp=args.trainer_tp, dtype="float32")
    topo = Topology(spec, par, views=views_of(None, lora))
    shapes = None if lora is None else adapter_tensors(spec, lora)
    params = load_rank(topo.trainer_layout, rank, random_source(spec, 0, shapes=shapes))
    vllm = args.engine == "vllm"
    control = ControlConfig(channel="vllm", token=VLLM_TOKEN) if vllm else ControlConfig()
    sync = WeightSync(spec, par, rank, params, [url],
                      SyncConfig(lora=lora, control=control,
                                 transport=TransportConfig(bucket_mb=args.bucket_mb, timeout_s=600)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    rows = []
    for version in range(1, args.warmup + args.updates + 1):
        for t in params.values():  # a new version of every synced tensor (a training step's worth)
            t.add_(1e-4)
        rec = sync.update(version, mode=None if vllm else "p2p")  # vLLM takes an adapter whole: broadcast
        if version > args.warmup:
            rows.append({"total_s": rec.total_s, "pause_s": rec.pause_s, "bytes": sum(rec.link_bytes.values()),
                         "mode": rec.mode,
                         "derive_s": rec.phases.get("derive", 0.0), "adapter": rec.adapter})
    ok = sync.verify() == []
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"rows": rows, "checksum_ok": ok}))


def bench_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    name, rank, merge = case
    lora = Lora(rank, 2.0 * rank) if rank else None
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as root:
        proc, url = _engine(args.model, args, lora, merge, root)
        try:
            res = run_ranks(_trainer, args.trainer_tp, (args.trainer_tp, free_port(), url, args, lora))
        finally:
            _stop(proc, args)
    rows = res[0]["rows"]
    return {"case": name, "lora_rank": rank, "merge": merge,
            "median_s": statistics.median(r["total_s"] for r in rows),
            "pause_median_s": statistics.median(r["pause_s"] for r in rows),
            "merge_median_s": statistics.median(r["derive_s"] for r in rows),
            "bytes": rows[0]["bytes"], "mode": rows[0]["mode"], "adapter": rows[0]["adapter"], "n": len(rows),
            "checksum_ok": all(r["checksum_ok"] for r in res.values())}


def _stop(proc: subprocess.Popen, args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        from shardsync.engines.vllm import serve

        serve.stop(proc)
        return
    proc.terminate()
    proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen2.5-0.5B", help="preset or config.json")
    ap.add_argument("--rank", type=int, action="append", help="LoRA ranks (repeatable; default 8 and 64)")
    ap.add_argument("--trainer-tp", type=int, default=2)
    ap.add_argument("--engine-tp", type=int, default=2)
    ap.add_argument("--updates", type=int, default=5, help="measured updates per case")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=64)
    ap.add_argument("--no-merge", action="store_true", help="skip the merging engines")
    ap.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                    help="vllm: real vLLM servers (run in vLLM's virtualenv; no merge cases)")
    ap.add_argument("--out", default="lora_update.json")
    args = ap.parse_args()
    ranks = args.rank or [8, 64]
    cases: list[Case] = [("full model", 0, False)]
    cases += [(f"adapter r{r}", r, False) for r in ranks]
    cases += [] if args.no_merge or args.engine == "vllm" else [(f"merge r{r}", r, True) for r in ranks]
    results = [bench_case(c, args) for c in cases]
    MiB = 2**20
    engine = "vLLM" if args.engine == "vllm" else "reference engine"
    print(f"{args.model}: trainer TP{args.trainer_tp} -> {engine} TP{args.engine_tp}, "
          f"{args.updates} measured updates per case")
    print(f"{'case':<14} {'path':>9} {'median ms':>10} {'MiB moved':>10} {'vs full':>8} {'pause ms':>9} "
          f"{'merge ms':>9} {'checksum':>9}")
    full = results[0]
    for r in results:
        print(f"{r['case']:<14} {r['mode']:>9} {r['median_s'] * 1e3:>10.1f} {r['bytes'] / MiB:>10.2f} "
              f"{r['bytes'] / full['bytes']:>8.3f} {r['pause_median_s'] * 1e3:>9.2f} "
              f"{r['merge_median_s'] * 1e3:>9.1f} {'ok' if r['checksum_ok'] else 'MISMATCH':>9}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "args": vars(args), "results": results}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
