"""One GPU, the same Qwen3-4B-sized bf16 weights, side by side in one run:

(a) checkpoint-engine (PyPI ``checkpoint-engine``, MoonshotAI) - its ``ParameterServer``
    pushing from pinned host memory into a receiving process, which takes the buckets with
    ``update_weights_from_ipc`` and a loader that writes the engine layout (fused QKV,
    gate/up) - what an engine plugged into it would do;
(b) shardsync from weights offloaded to pinned host memory (map path, H2D);
(c) shardsync map from resident GPU weights (D2D);
(d) the copy limits: one D2D and one pinned H2D copy of the model's bytes.

Each row lands bitwise (checksums of the engine's tensors against the expected ones).

    cd benchmarks && python peers_gpu.py --model Qwen3-4B --updates 5 --out peers_gpu.json

checkpoint-engine and its needs (pyzmq, loguru, safetensors) are not shardsync dependencies;
install them beside it (docs/gpu.md says how they were carried to the GPU machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.multiprocessing as mp
from gpu_update import d2d_copy_ms, fast_source, h2d_copy_ms, ipc_updates

from shardsync.control.client import wait_healthy
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.layout import EngineParallel, MegatronParallel, engine_layout
from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import load_rank
from shardsync.piece import addressed
from shardsync.plan.local import region
from shardsync.presets import load_spec
from shardsync.runtime.checksum import piece_checksums
from shardsync.store.rendezvous import free_port
from shardsync.topology import Topology


def _sums(tensors: dict[str, torch.Tensor], model: str) -> dict[str, int]:
    """Bitwise checksums of the engine-layout ``tensors`` per logical piece (``runtime.checksum``,
    what ``WeightSync.verify`` compares), keys as strings."""
    layout = engine_layout(load_spec(model, dtype="bfloat16"), EngineParallel(tp=1, dtype="bfloat16"))
    rank = layout.ranks[0]
    meta = {t.name: t for t in rank.tensors}
    views = {n: addressed(t, meta[n]) for n, t in tensors.items()}
    return {str(k): v for k, v in piece_checksums(rank, views, layout.logical, torch.bfloat16).items()}


def _receiver(conn, model: str) -> None:
    """The engine side of (a): engine-layout tensors on the GPU, filled by checkpoint-engine's
    ``update_weights_from_ipc`` through a loader that places each HF tensor's pieces."""
    import zmq
    from checkpoint_engine.worker import update_weights_from_ipc

    torch.cuda.set_device(0)
    spec = load_spec(model, dtype="bfloat16")
    rank = engine_layout(spec, EngineParallel(tp=1, dtype="bfloat16")).ranks[0]
    meta = {t.name: t for t in rank.tensors}
    dst = {t.name: torch.zeros(t.stored, dtype=torch.bfloat16, device="cuda") for t in rank.tensors}
    views = {n: addressed(t, meta[n]) for n, t in dst.items()}
    pieces = defaultdict(list)
    for p in rank.pieces:
        pieces[p.logical].append(p)

    def load(weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            for p in pieces[name]:
                views[p.local][region(tuple(p.local_offsets), tuple(p.sizes))].copy_(
                    t[region(tuple(p.offsets), tuple(p.sizes))])

    ctx = zmq.Context()
    while True:
        msg = conn.recv()
        if msg == "stop":
            return
        if msg == "checksum":
            torch.cuda.synchronize()
            conn.send(_sums(dst, model))
            continue
        update_weights_from_ipc(ctx, msg, 0, run=load)
        conn.send("done")


def checkpoint_engine_updates(spec, hf: dict[str, torch.Tensor], expected: dict[str, int], args) -> dict:
    from checkpoint_engine.ps import ParameterServer

    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, args.model), daemon=True)
    proc.start()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    try:
        ps = ParameterServer(rank=0, world_size=1, master_addr="127.0.0.1", master_port=free_port())
        t0 = time.perf_counter()
        ps.register_checkpoint("weights", named_tensors={n: t.cpu() for n, t in hf.items()})
        register_s = time.perf_counter() - t0
        ps.gather_metas("weights")

        def request(socket_paths: list[tuple[str, str]]) -> None:
            here.send(socket_paths[0][1])
            assert here.recv() == "done"

        times = []
        for _ in range(args.updates + 1):  # the first is a warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ps.update("weights", request)
            times.append(time.perf_counter() - t0)
        here.send("checksum")
        got = here.recv()
        here.send("stop")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    bad = sorted(n for n in expected if got.get(n) != expected[n])
    return {"update_ms": statistics.median(times[1:]) * 1e3, "max_ms": max(times[1:]) * 1e3,
            "register_s": register_s, "checksum_ok": not bad, "mismatch": bad[:3], "times_ms": [t * 1e3 for t in times]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--out", default="peers_gpu.json")
    args = ap.parse_args()
    spec = load_spec(args.model, dtype="bfloat16")
    layout = engine_layout(spec, EngineParallel(tp=1, dtype="bfloat16"))
    model_bytes = sum(t.numel for t in layout.ranks[0].tensors) * 2
    d2d_ms, h2d_ms = d2d_copy_ms(model_bytes), h2d_copy_ms(model_bytes)
    print(f"{spec.name}: {model_bytes / 2**30:.2f} GiB bf16; D2D {d2d_ms:.2f} ms, pinned H2D {h2d_ms:.1f} ms",
          flush=True)

    engine, url = spawn_server(EngineConfig(model=args.model, port=0, device="cuda", dtype="bfloat16",
                                            threads=4))
    try:
        source = fast_source(spec, 7)
        hf = {n: source(n).to(torch.bfloat16) for n in logical_tensors(spec)}
        expected = _sums(load_rank(layout, 0, hf.__getitem__, device="cuda"), args.model)
        ce = checkpoint_engine_updates(spec, hf, expected, args)
        del hf
        torch.cuda.empty_cache()
        print(f"(a) checkpoint-engine from pinned host: {ce['update_ms']:.1f} ms per update "
              f"(register {ce['register_s']:.1f} s), checksum {'ok' if ce['checksum_ok'] else ce['mismatch']}",
              flush=True)
        par = MegatronParallel(tp=1, dtype="bfloat16")
        params = load_rank(Topology(spec, par).trainer_layout, 0, source, device="cuda")
        wait_healthy(url, engine, 600)
        ns = argparse.Namespace(updates=args.updates * 2, bucket_mb=args.bucket_mb)
        host = ipc_updates("host", "store", "stream", "mailbox", spec, par, params, url, ns, first=1)
        dev = ipc_updates("map", "store", "stream", "mailbox", spec, par, params, url, ns, first=2 + ns.updates)
    finally:
        engine.terminate()
        engine.wait(60)
    rows = [("(a) checkpoint-engine 0.4.2, pinned host -> receiving process", ce["update_ms"], h2d_ms,
             ce["checksum_ok"]),
            ("(b) shardsync map from pinned host (offloaded), whole update", host["total_ms"], h2d_ms,
             host["checksum_ok"]),
            ("(c) shardsync map from GPU weights, whole update", dev["total_ms"], d2d_ms, dev["checksum_ok"]),
            ("(d) pinned H2D copy of the bytes", h2d_ms, h2d_ms, True),
            ("(d) D2D copy of the bytes", d2d_ms, d2d_ms, True)]
    print("\n| path | median ms | x its copy limit | bitwise |\n|---|---|---|---|")
    for name, ms, limit, ok in rows:
        print(f"| {name} | {ms:.2f} | {ms / limit:.2f} | {'ok' if ok else 'MISMATCH'} |")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "model": spec.name, "model_bytes": model_bytes, "d2d_ms": d2d_ms,
                   "h2d_ms": h2d_ms, "checkpoint_engine": ce, "shardsync_host": host, "shardsync_map": dev}, f,
                  indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
