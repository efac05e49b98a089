"""One GPU, colocated: a trainer process and an engine server share the device; full
updates go through CUDA IPC.  In one run: a plain device-to-device copy of the model's
bytes (the limit); in-process pack, unpack and mapped-copy throughput; full updates with
the IPC kinds ("map": the engine reads the trainer's weights in place; "slots": buckets
staged through exported buffers; "push": the trainer writes a staged engine's staging copy)
and both control planes (begin/finish through the sync
store or over HTTP) with their phases and the bitwise checksum; delta
encode/apply throughput on the device at 1 % and 10 % density.  An update counts until its
copies finished on the GPU ("complete": ``update()`` then a synchronize of the trainer's
stream, which the engine's event orders after its copies); ``update()`` alone may return
earlier (map with ``complete="stream"``: once the copies are queued).

    python benchmarks/gpu_update.py --model Qwen3-4B --updates 10 --out gpu_update.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from shardsync.config import ColocatedConfig, ControlConfig, SyncConfig, TransportConfig
from shardsync.control.client import wait_healthy
from shardsync.delta.encode import decode, encode
from shardsync.delta.parts import Part, apply_values
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.layout import MegatronParallel
from shardsync.models.weights import load_rank, random_source
from shardsync.presets import load_spec
from shardsync.sync import WeightSync
from shardsync.topology import Topology
from shardsync.transport.gather import configured
from shardsync.views import views_of


def cuda_ms(fn, iters: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def d2d_copy_ms(nbytes: int) -> float:
    """A plain device-to-device copy of ``nbytes``: the floor for moving the weights once."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = cuda_ms(lambda src=src, dst=dst: dst.copy_(src))  # bound as defaults: the lambda goes with the call
    del src, dst  # free both before the model is loaded
    torch.cuda.empty_cache()
    return ms


def h2d_copy_ms(nbytes: int) -> float:
    """A pinned host-to-device copy of ``nbytes``: the floor for offloaded weights."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.bfloat16, device="cuda")
    ms = cuda_ms(lambda src=src, dst=dst: dst.copy_(src, non_blocking=True), iters=3)
    del src, dst
    torch.cuda.empty_cache()
    return ms


def fast_source(spec, seed: int):
    """Random logical tensors generated on the GPU (a 4B model in seconds, not minutes)."""
    base = random_source(spec, seed)

    def get(name: str) -> torch.Tensor:
        from shardsync.layout.logical import logical_tensors

        shape = logical_tensors(spec)[name]
        if len(shape) == 1:
            return base(name)
        g = torch.Generator(device="cuda").manual_seed(hash((seed, name)) % 2**31)
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    return get


def delta_throughput(numel: int, density: float) -> dict:
    old = (torch.randn(numel, device="cuda") * 0.02).to(torch.bfloat16)
    new = old.clone()
    idx = torch.randperm(numel, device="cuda")[: int(numel * density)]
    new[idx] = (torch.randn(idx.numel(), device="cuda") * 0.02).to(torch.bfloat16)
    part = Part(0, "w", (0,), "w", (0,), (numel,))
    box = (slice(0, numel),)
    blob = encode(new, old)
    enc_ms = cuda_ms(lambda: encode(new, old))
    target = old.clone()

    def apply() -> None:
        pos, vals = decode(blob, numel, torch.bfloat16)
        apply_values(part, pos, vals, {"w": target}, [("w", box, box)])

    app_ms = cuda_ms(apply)
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))
    gb = numel * 2 / 1e9
    return {"density": density, "encode_GBps": gb / enc_ms * 1e3, "apply_GBps": gb / app_ms * 1e3,
            "payload_fraction": blob.numel() / (numel * 2)}


def quantize_GBps(topo: Topology, params: dict) -> dict:
    """An FP8 engine's weights quantized by the trainer before a send (``runtime.quantizer``): the
    fused kernels replayed as one graph (one read of the bf16 weights, a write of the e4m3
    bytes; counting the changed bytes also reads the kept ones) against the same regions
    through the torch ops, as GB/s of bf16 read."""
    from shardsync.quant.fp8 import quantize
    from shardsync.runtime.quantizer import SourceQuantizer

    assert topo.fp8 is not None
    fmt = topo.fp8.fmt
    source = SourceQuantizer(topo.derived(0), params, fmt, count=False)
    counting = SourceQuantizer(topo.derived(0), params, fmt, count=True)
    regions = [source.region(d) for d in source.derived]
    gb = sum(r.numel() for r in regions) * 2 / 1e9

    def torch_ops() -> None:
        for r in regions:
            quantize(r, fmt)

    return {"fused_GBps": gb / cuda_ms(lambda: source.refresh(), iters=10) * 1e3,
            "fused_counted_GBps": gb / cuda_ms(lambda: counting.refresh(), iters=10) * 1e3,
            "torch_GBps": gb / cuda_ms(torch_ops) * 1e3, "bf16_GB": gb, "regions": len(regions)}


def kernels_GBps(topo: Topology, params: dict, bucket_bytes: int) -> dict:
    """In one process, no IPC: the copy kernels each path runs, as throughput of model bytes."""
    from shardsync.plan.local import allocate
    from shardsync.plan.runs import coalesce, compile_runs
    from shardsync.runtime.executor import drain, pack
    from shardsync.runtime.schedule import p2p_steps
    from shardsync.transport.copies import SIDE_STREAMS, Copies

    engine = allocate(topo.p2p_plan, 0, device="cuda")
    send = p2p_steps(topo, 0, bucket_bytes)
    recv = p2p_steps(topo, topo.trainer.world_size, bucket_bytes)
    buf = torch.empty(max(s.numel for s in send), dtype=torch.bfloat16, device="cuda")

    def pack_all() -> None:
        for s in send:
            pack(s, buf, params)

    def unpack_all() -> None:
        for s in recv:
            drain(s, buf, engine)

    pairs = compile_runs(coalesce(topo.p2p_plan.copies), params, engine)
    copies = Copies.of(pairs, gather=False)  # per-copy launches (the gather kernel is measured below)
    streams = [torch.cuda.Stream() for _ in range(SIDE_STREAMS)]

    def mapped() -> None:
        copies.run(streams)

    def mapped_one_stream() -> None:
        copies.run()

    gb = topo.p2p_plan.total_bytes / 1e9
    out = {name: gb / cuda_ms(fn) * 1e3 for name, fn in (("pack", pack_all), ("unpack", unpack_all),
                                                          ("mapped_copy", mapped),
                                                          ("mapped_copy_one_stream", mapped_one_stream))}
    from shardsync.transport.gather import Gather, available

    if available():  # one launch over a tile table, per tile size; bitwise against the per-copy path
        reference = {n: t.clone() for n, t in engine.items()}
        for t in engine.values():
            t.zero_()
        gather = Gather(pairs)  # what the mapped path runs where Triton is installed
        out["mapped_gather"] = gb / cuda_ms(gather.run, iters=10) * 1e3
        torch.cuda.synchronize()
        out["mapped_gather_bitwise"] = all(
            torch.equal(engine[n].view(torch.uint8), reference[n].view(torch.uint8)) for n in engine)
        out["gather_word_bytes"] = gather.word
    out["mapped_copies"] = len(pairs)
    out["plan_copies"] = len(topo.p2p_plan.copies)
    return out


def ipc_updates(kind: str, control: str, complete: str, signals: str, spec, par, params: dict, url: str, args,
                first: int) -> dict:
    """Connect with one IPC kind and control plane, run ``--updates`` full updates after a
    warm-up, verify.  Kind ``host``: the trainer's weights offloaded to (pinned) host memory,
    read by the engine through the map path (H2D copies)."""
    if kind == "host":
        params = {k: v.cpu().pin_memory() for k, v in params.items()}
    sync = WeightSync(spec, par, 0, params, [url],
                      SyncConfig(mode="p2p", colocated=ColocatedConfig(ipc="map" if kind == "host" else kind,
                                                                       complete=complete, signals=signals),
                                 control=ControlConfig(channel=control, http_timeout_s=300),
                                 transport=TransportConfig(bucket_mb=args.bucket_mb, timeout_s=300)))
    sync.connect()
    recs, returned, done = [], [], []
    try:
        for v in range(first, first + args.updates + 1):  # versions only grow on an engine
            params["embedding.word_embeddings.weight"][0, v % 7] += 1.0  # a change every update
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            recs.append(sync.update(v))
            returned.append(time.perf_counter() - t0)
            torch.cuda.synchronize()  # the trainer's stream waits for the engine's copies
            done.append(time.perf_counter() - t0)
        bad = sync.verify()
    finally:
        sync.close()
    measured = recs[1:]
    med = {k: statistics.median(r.phases[k] for r in measured) * 1e3
           for k in ("pack", "transfer", "unpack", "control", "total")}
    # the data path: from the trainer's first byte handed over to the engine's last ack
    data = [(r.phases["pack"] + r.phases["transfer"]) * 1e3 for r in measured]
    return {"kind": kind, "control": control, "complete": complete, "signals": signals, "source": recs[-1].source,
            "data_ms": statistics.median(data), "data_p99_ms": max(data),
            "total_ms": statistics.median(done[1:]) * 1e3, "returned_ms": statistics.median(returned[1:]) * 1e3,
            "total_max_ms": max(done[1:]) * 1e3,
            "phases_ms": med, "checksum_ok": not bad, "mismatch": bad[:3],
            "records": [r.phases for r in recs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen3-4B")
    ap.add_argument("--updates", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--runs", default="map:store,map:store:host,map:http,slots:store,host:store",
                    help="IPC kind:control plane[:complete[:signals]] to compare, comma separated (host: map "
                         "from weights offloaded to pinned host memory; push: the trainer writes the staging copy "
                         "of an engine that stages whole shards, run after the others; complete: stream (default) "
                         "or host; signals: mailbox (default) or group)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip the in-process kernel measures (they hold two more copies of the model: "
                         "Qwen3-14B does not fit beside the engine on one H200 with them)")
    ap.add_argument("--engine-quantization", default=None,
                    help="the engine serves FP8 in this format (e.g. fp8): the trainer quantizes before each "
                         "send; the in-process kernels measured are the quantizer's")
    ap.add_argument("--out", default="gpu_update.json")
    args = ap.parse_args()
    spec = load_spec(args.model, dtype="bfloat16")
    par = MegatronParallel(tp=1, dtype="bfloat16")
    topo = Topology(spec, par, views=views_of(args.engine_quantization))
    model_bytes = sum(t.numel for t in Topology(spec, par).engines_layout.ranks[0].tensors) * 2  # bf16
    d2d_ms = d2d_copy_ms(model_bytes)
    h2d_ms = h2d_copy_ms(model_bytes)
    print(f"{spec.name}: {model_bytes / 2**30:.2f} GiB of bf16 weights; D2D copy {d2d_ms:.2f} ms "
          f"({model_bytes / d2d_ms / 1e6:.0f} GB/s counting bytes once); pinned H2D copy {h2d_ms:.1f} ms",
          flush=True)

    print(f"gather kernel: {configured()}", flush=True)
    plan = [(run.split(":") + ["stream", "mailbox"][len(run.split(":")) - 2:])[:4] for run in args.runs.split(",")]
    # push writes an engine's staging copy: those runs go to an engine that stages whole shards,
    # started once the in-place engine's runs are done (one engine beside the trainer at a time)
    plan.sort(key=lambda r: r[0] == "push")
    staged = plan[0][0] == "push"
    engine, url = spawn_server(EngineConfig(model=args.model, port=0, device="cuda", dtype="bfloat16",
                                            threads=4, staging_bytes=-1 if staged else 0,
                                            quantization=args.engine_quantization))
    runs = []
    try:
        t0 = time.time()
        wait_healthy(url, engine, 500)  # its load peaks before the trainer's does (a 14B pair fits then)
        params = load_rank(topo.trainer_base, 0, fast_source(spec, 1), device="cuda")
        torch.cuda.empty_cache()  # the float32 temporaries of the random source
        print(f"trainer weights ready in {time.time() - t0:.1f}s", flush=True)
        quant = {} if topo.fp8 is None else quantize_GBps(topo, params)
        if quant:
            print(f"trainer FP8 quantize ({args.engine_quantization}, {quant['regions']} regions, "
                  f"{quant['bf16_GB']:.2f} GB of bf16): fused {quant['fused_GBps']:.0f} GB/s (counting the changed "
                  f"bytes {quant['fused_counted_GBps']:.0f} GB/s), "
                  f"torch ops {quant['torch_GBps']:.0f} GB/s of bf16 read", flush=True)
        kernels = {} if args.no_kernels or quant else kernels_GBps(topo, params, int(args.bucket_mb * 2**20))
        torch.cuda.empty_cache()
        if kernels:
            print(f"in-process kernels (GB/s of model bytes): pack {kernels['pack']:.0f}, "
                  f"unpack {kernels['unpack']:.0f}, "
                  f"mapped copy {kernels['mapped_copy']:.0f} (one stream: {kernels['mapped_copy_one_stream']:.0f}; "
                  f"{kernels['mapped_copies']} strided copies for "
                  f"{kernels['plan_copies']} plan copies)", flush=True)
        if "mapped_gather" in kernels:
            print(f"one gather launch: {kernels['mapped_gather']:.0f} GB/s (bitwise vs per-copy launches: "
                  f"{kernels['mapped_gather_bitwise']})", flush=True)
        for i, (kind, control, complete, signals) in enumerate(plan):
            if (kind == "push") != staged:
                engine.terminate()
                engine.wait(60)
                staged = kind == "push"
                engine, url = spawn_server(EngineConfig(model=args.model, port=0, device="cuda",
                                                        dtype="bfloat16", threads=4, staging_bytes=-1,
                                                        quantization=args.engine_quantization))
                wait_healthy(url, engine, 500)
            r = ipc_updates(kind, control, complete, signals, spec, par, params, url, args,
                            first=1 + i * (args.updates + 1))
            runs.append(r)
            limit, name = (h2d_ms, "H2D") if kind == "host" else (d2d_ms, "D2D")
            print(f"IPC {kind:5s} control={control:5s} complete={complete:6s} signals={signals:7s} "
                  f"(trainer TP1 -> engine TP1, same GPU, "
                  f"{args.updates} updates): data path "
                  f"median {r['data_ms']:.2f} ms (max {r['data_p99_ms']:.2f}); whole update until complete on the "
                  f"GPU {r['total_ms']:.2f} ms = {r['total_ms'] / limit:.2f}x {name} (update() returned after "
                  f"{r['returned_ms']:.2f} ms); phases ms "
                  f"{ {k: round(v, 2) for k, v in r['phases_ms'].items()} }; checksum "
                  f"{'ok' if r['checksum_ok'] else r['mismatch']}", flush=True)
    finally:
        engine.terminate()
        engine.wait(60)
    deltas = [delta_throughput(256 * 2**20, d) for d in (0.01, 0.10)]
    for d in deltas:
        print(f"delta on device, 512 MiB bf16 at density {d['density']:.2f}: encode {d['encode_GBps']:.1f} GB/s, "
              f"apply {d['apply_GBps']:.1f} GB/s, payload {d['payload_fraction']:.3f} of full")
    print("\n| path | median ms | x its copy limit |\n|---|---|---|")
    print(f"| D2D copy (one kernel) | {d2d_ms:.2f} | 1.00 |")
    print(f"| pinned H2D copy (one call) | {h2d_ms:.2f} | 1.00 |")
    for r in runs:
        limit = h2d_ms if r["kind"] == "host" else d2d_ms
        name = f"IPC {r['kind']}, control {r['control']}, complete {r['complete']}, signals {r['signals']}"
        print(f"| {name}: update() returned | {r['returned_ms']:.2f} | {r['returned_ms'] / limit:.2f} |")
        print(f"| {name}: whole update, complete on the GPU | {r['total_ms']:.2f} | {r['total_ms'] / limit:.2f} |")
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(),
                   "torch": torch.__version__, "model": spec.name, "model_bytes": model_bytes,
                   "gather_tuning": configured().__dict__,
                   "d2d_ms": d2d_ms, "h2d_ms": h2d_ms, "kernels_GBps": kernels, "ipc": runs, "delta": deltas,
                   "engine_quantization": args.engine_quantization, "quantize": quant},
                  f, indent=2)


if __name__ == "__main__":
    main()
