"""Delta sync on real optimizer steps of the reference trainer (bf16 weights, fp32 master).

Part 1 (one process): for each learning rate, K AdamW steps of a GRPO-style loss; per
step the changed-element density of the bf16 weights, the bytes of every encoding
(dense, sparse32, gap16, xor+zstd, and the per-part choice) against the full bytes, and
encode / apply throughput.  Part 2 (full stack): an engine server and trainer ranks with
``WeightSync(mode="delta")``; after each step a delta update and a full p2p resync of the
same version, side by side (median times), for each delta transport.

    python benchmarks/delta.py --lrs 1e-6,1e-5,1e-4 --steps 4 --out delta.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardsync.delta.encode import (
    DENSE,
    GAP16,
    SPARSE32,
    changed_positions,
    decode,
    encode,
    xor_encode,
)
from shardsync.delta.parts import Part, apply_values
from shardsync.layout import MegatronParallel
from shardsync.models.trainer import TrainerModel
from shardsync.models.training import OptimConfig, grpo_loss
from shardsync.models.weights import random_source
from shardsync.presets import PRESETS

sys.path.insert(0, os.path.dirname(__file__))

from shardsync.control.client import wait_healthy  # noqa: E402
from shardsync.engine.launch import EngineConfig, spawn_server  # noqa: E402
from shardsync.store.rendezvous import free_port

SPEC = PRESETS["tiny-qwen3"].replace(name="bench-qwen3", hidden_size=512, num_layers=4, num_heads=8,
                                    num_kv_heads=2, head_dim=64, intermediate_size=1536, vocab_size=4000,
                                    dtype="bfloat16")


def _loss_step(model: TrainerModel, g: torch.Generator) -> None:
    ids = torch.randint(0, SPEC.vocab_size, (8, 32), generator=g)
    old = model.policy_logprobs(ids)
    adv = torch.randn(8, generator=g)
    model.train_step(ids, functools.partial(grpo_loss, old_logprobs=old, advantages=adv,
                                            mask=torch.ones(8, 31)))


def encodings_for(model: TrainerModel, before: dict[str, torch.Tensor]) -> dict:
    """Bytes per encoding over all tensors, plus encode/apply seconds of the chosen one."""
    sizes: Counter = Counter()
    changed = total = 0
    enc_s = apply_s = xor_s = 0.0
    for name, p in model.named_parameters():
        new = p.detach().to(torch.bfloat16)
        old = before[name]
        n, k = new.numel(), changed_positions(new, old).numel()
        changed, total = changed + k, total + n
        sizes["full"] += 2 * n
        sizes["dense"] += 2 * n
        sizes["sparse32"] += k * 6
        sizes["gap16"] += k * 4  # lower bound: fillers only on gaps > 65535
        t0 = time.perf_counter()
        blob = encode(new, old)
        t1 = time.perf_counter()
        pos, vals = decode(blob, n, torch.bfloat16)
        target = old.clone()
        part = Part(0, name, (0,) * new.dim(), name, (0,) * new.dim(), tuple(new.shape))
        apply_values(part, pos, vals, {name: target}, [(name, tuple(slice(0, s) for s in new.shape),
                                                         tuple(slice(0, s) for s in new.shape))])
        t2 = time.perf_counter()
        assert torch.equal(target.view(torch.int16), new.view(torch.int16))
        sizes["chosen"] += blob.numel()
        t3 = time.perf_counter()
        sizes["xor+zstd"] += len(xor_encode(new, old))
        xor_s += time.perf_counter() - t3
        enc_s, apply_s = enc_s + t1 - t0, apply_s + t2 - t1
    return {"density": changed / total, "bytes": dict(sizes), "encode_s": enc_s, "apply_s": apply_s,
            "xor_encode_s": xor_s, "elements": total}


def part1(lrs: list[float], steps: int) -> list[dict]:
    rows = []
    for lr in lrs:
        model = TrainerModel(SPEC, MegatronParallel(), 0, source=random_source(SPEC, 0),
                             optim=OptimConfig(lr=lr))
        g = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            before = {n: p.detach().to(torch.bfloat16).clone() for n, p in model.named_parameters()}
            _loss_step(model, g)
            r = encodings_for(model, before)
            rows.append({"lr": lr, "step": step, **r})
    return rows


def _trainer(rank: int, world: int, port: int, url: str, args, transport: str, root: str, out) -> None:
    from shardsync.config import DeltaConfig, SyncConfig, TransportConfig
    from shardsync.sync import WeightSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from shardsync.models.trainer import megatron_groups

    par = MegatronParallel(tp=world, dtype="float32")
    groups = megatron_groups(par)
    model = TrainerModel(SPEC, par, rank, groups.tp, groups.pp, source=random_source(SPEC, 0),
                         optim=OptimConfig(lr=args.e2e_lr))
    sync = WeightSync(SPEC, par, rank, dict(model.named_parameters()), [url],
                      SyncConfig(delta=DeltaConfig(transport=transport, dir=root),
                                 transport=TransportConfig(bucket_mb=16, timeout_s=600)),
                      trainer_group=dist.group.WORLD)
    sync.connect()
    g = torch.Generator().manual_seed(1)
    sync.update(0)
    rows = []
    for version in range(1, args.steps + 1):
        _loss_step(model, g)
        d = sync.update(version)
        f = sync.update(version, mode="p2p")  # same weights, full path, same run
        rows.append({"delta_s": d.phases["total"], "full_s": f.phases["total"], "path": d.mode,
                     "delta_bytes": d.delta["bytes_sent"] if d.delta else None,
                     "delta_phases": d.phases, "full_phases": f.phases})
    ok = sync.verify() == []
    sync.close()
    dist.destroy_process_group()
    out.put((rank, {"rows": rows, "ok": ok}))


def part2(args) -> list[dict]:
    res = []
    for transport in args.transports.split(","):
        proc, url = spawn_server(EngineConfig(model=_spec_config(), tp=2, port=0))
        wait_healthy(url, proc, 900)
        try:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            port = free_port()
            root = tempfile.mkdtemp(prefix="shardsync-delta-")
            procs = [ctx.Process(target=_trainer, args=(r, 2, port, url, args, transport, root, q))
                     for r in range(2)]
            for p in procs:
                p.start()
            got: dict[int, dict] = {}
            deadline = time.monotonic() + 1800
            while len(got) < len(procs):
                try:
                    rank, value = q.get(timeout=2)
                    got[rank] = value
                except Exception:
                    if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                        raise RuntimeError(f"trainer ranks failed ({transport})") from None
            for p in procs:
                p.join(60)
        finally:
            proc.terminate()
            proc.wait(60)
        rows = got[0]["rows"]
        res.append({"transport": transport, "checksum_ok": got[0]["ok"], "rows": rows,
                    "delta_median_s": statistics.median(r["delta_s"] for r in rows),
                    "full_median_s": statistics.median(r["full_s"] for r in rows)})
    return res


_CONFIG_DIR = tempfile.mkdtemp(prefix="shardsync-spec-")


def _spec_config() -> str:
    path = os.path.join(_CONFIG_DIR, "config.json")
    if not os.path.exists(path):
        with open(path, "w") as f:
            json.dump(SPEC.to_hf_config(), f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lrs", default="1e-6,1e-5,1e-4")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--e2e-lr", type=float, default=1e-5)
    ap.add_argument("--transports", default="p2p,broadcast,disk")
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--out", default="delta.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lrs = [float(x) for x in args.lrs.split(",") if x and x != "none"]
    rows = part1(lrs, args.steps)
    print(f"model {SPEC.num_parameters() / 1e6:.1f} M params, bf16 weights, fp32 master, AdamW")
    print(f"{'lr':>7} {'step':>4} {'density':>8} {'full KiB':>9} {'sparse32':>9} {'gap16':>8} {'xor+zstd':>9} "
          f"{'chosen':>8} {'enc GB/s':>9} {'apply GB/s':>10} {'xor GB/s':>9}")
    for r in rows:
        b, full = r["bytes"], r["bytes"]["full"]

        def rate(s: float, full: int = full) -> float:
            return full / s / 1e9 if s > 0 else 0.0

        print(f"{r['lr']:>7.0e} {r['step']:>4} {r['density']:>8.4f} {full / 1024:>9.0f} "
              f"{b['sparse32'] / full:>9.3f} {b['gap16'] / full:>8.3f} {b['xor+zstd'] / full:>9.3f} "
              f"{b['chosen'] / full:>8.3f} {rate(r['encode_s']):>9.2f} {rate(r['apply_s']):>10.2f} "
              f"{rate(r['xor_encode_s']):>9.2f}")
    print("(encodings as a fraction of the full bf16 bytes; throughput counts the full bytes)")
    e2e = [] if args.skip_e2e else part2(args)
    if e2e:
        print(f"end to end, trainer TP2 -> engine TP2 (bf16), lr {args.e2e_lr}, {args.steps} steps:")
        print(f"{'transport':<10} {'delta ms':>9} {'full p2p ms':>12} {'delta/full':>10} {'checksum':>9}")
        for r in e2e:
            print(f"{r['transport']:<10} {r['delta_median_s'] * 1e3:>9.1f} {r['full_median_s'] * 1e3:>12.1f} "
                  f"{r['delta_median_s'] / r['full_median_s']:>10.2f} {'ok' if r['checksum_ok'] else 'MISMATCH':>9}")
    with open(args.out, "w") as f:
        json.dump({"machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus",
                   "spec": SPEC.name, "params": SPEC.num_parameters(), "density": rows, "e2e": e2e},
                  f, indent=2, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    _ = (DENSE, SPARSE32, GAP16)
    main()
