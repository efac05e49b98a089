"""Run a sweep on every rank of a world, spawned here or launched by torchrun.

Collective contract: every rank calls ``run_sweep`` with the same config and world size.
Per configuration each rank compiles its program, runs the warm-up and the measured
iterations (each starts with a world barrier), then hands its timestamps to rank 0
through the TCPStore; rank 0 alone computes metrics and writes the report.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from shardsync.bench import report
from shardsync.bench.metrics import aggregate, iteration_metrics
from shardsync.bench.policy import WavePlan, plan_waves
from shardsync.bench.provenance import Provenance, ProvenanceError
from shardsync.bench.schedule import Done, Go, Item, effective_credits, global_order, rank_program
from shardsync.bench.sweep import BenchConfig, Point, expand
from shardsync.bench.topology import BenchLayout, partition
from shardsync.bench.transport import CLOCK, TracingTransport, group_barrier, make_pool
from shardsync.bench.workload import Workload, from_plan, synthetic
from shardsync.launch.procs import start_all, worker_context
from shardsync.placement import rank_device
from shardsync.runtime.executor import execute
from shardsync.store import free_port
from shardsync.store.rendezvous import Rendezvous, open_store
from shardsync.store.secret import load_secret
from shardsync.transport import SyncGroup

log = logging.getLogger(__name__)
_clock = time.perf_counter
DEFAULT_NPROC = 5


@dataclass(frozen=True)
class Prepared:
    """Everything pure about a sweep, validated before any process starts."""

    layout: BenchLayout
    points: tuple[Point, ...]
    workloads: dict[tuple[str, int], Workload]
    waves: dict[Point, WavePlan]
    credits: dict[Point, int]


def prepare(cfg: BenchConfig, world_size: int) -> Prepared:
    """Partition, workloads, waves and credits of every point (raises ``ValueError`` early)."""
    group_size = cfg.engine_group_size
    if group_size is None and cfg.engine_group_sizes is None:
        group_size = 1
    layout = partition(world_size, trainer_ranks=cfg.trainer_ranks, group_size=group_size,
                       group_sizes=cfg.engine_group_sizes)
    points = tuple(expand(cfg))
    workloads: dict[tuple[str, int], Workload] = {}
    waves, credits = {}, {}
    for p in points:
        key = (p.transport, p.bucket_bytes)
        if key not in workloads:
            if cfg.model is None:
                workloads[key] = synthetic(layout, p.transport, nbytes=p.bucket_bytes, count=cfg.messages)
            else:
                workloads[key] = from_plan(layout, p.transport, model=cfg.model,
                                           trainer_tp=cfg.trainer_tp or cfg.trainer_ranks,
                                           engine_tp=cfg.engine_tp, bucket_bytes=p.bucket_bytes)
        waves[p] = plan_waves(p.policy, len(layout.groups), window=p.window, stride_s=p.stride_s)
        credits[p] = effective_credits(p.credits, p.inflight_cap_bytes, workloads[key].max_message_bytes)
    return Prepared(layout, points, workloads, waves, credits)


def resolve_device(name: str, local_rank: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name not in ("cuda", "cpu"):
        raise ValueError(f"--device {name!r}: use auto, cpu or cuda")
    return torch.device(rank_device(name, local_rank))


def _sleep_until(deadline: float) -> None:
    while (left := deadline - _clock()) > 0:
        if left > 2e-4:
            time.sleep(left - 1e-4)  # sleep coarsely, then spin the last stretch


def _run_program(program: list[Item], tracer: TracingTransport, pool, credits: int,
                 group: SyncGroup, is_trainer: bool) -> tuple[dict[str, float], list[list]]:
    """Run one rank's program; returns phase times and its barriers as (kind, group, in, out)."""
    phases = dict.fromkeys(("pack", "transfer", "unpack", "control", "gate"), 0.0)
    control: list[list] = []
    wave, wave_start = -1, 0.0
    for item in program:
        if isinstance(item, (Go, Done)):
            t = _clock()
            if isinstance(item, Go) and is_trainer and item.offset_s > 0:
                # a wave starts when its first group starts: the exit of its first go barrier
                _sleep_until(wave_start + item.offset_s)
                phases["gate"] += _clock() - t
                t = _clock()
            group_barrier(group, f"ctrl{item.group}")
            t_out = _clock()
            phases["control"] += t_out - t
            control.append(["go" if isinstance(item, Go) else "done", item.group, t, t_out])
            if isinstance(item, Go) and item.wave != wave:
                wave, wave_start = item.wave, t_out
        else:
            st = execute(list(item), {}, tracer, pool=pool, credits=credits)
            phases["pack"] += st.pack_s
            phases["transfer"] += st.transfer_s
            phases["unpack"] += st.unpack_s
    return phases, control


def _iteration(program, tracer, pool, credits, group, is_trainer) -> dict:
    group.barrier()
    group.synchronize()
    t0 = _clock()
    phases, control = _run_program(program, tracer, pool, credits, group, is_trainer)
    return {"t0": t0, "transfers": [r.row() for r in tracer.take()], "phases": phases, "control": control}


def _run_point(cfg: BenchConfig, prep: Prepared, point: Point, rank: int, group: SyncGroup,
               device: torch.device) -> dict:
    wl = prep.workloads[(point.transport, point.bucket_bytes)]
    program = rank_program(global_order(prep.waves[point], wl), rank, prep.layout)
    tracer = TracingTransport(group, prep.layout, rank, device)
    pool = make_pool(point.reuse, device)
    is_trainer = rank in prep.layout.trainers
    args = (program, tracer, pool, prep.credits[point], group, is_trainer)
    warmed = 0
    for _ in range(cfg.warmup):
        _iteration(*args)
        warmed += 1
    warm_syncs = tracer.device_syncs
    measured = [_iteration(*args) for _ in range(cfg.iters)]
    return {"warmup": warmed, "iterations": measured, "device_syncs": tracer.device_syncs - warm_syncs,
            "pool_allocated_bytes": pool.allocated_bytes}


def evaluate(cfg: BenchConfig, prep: Prepared, point: Point, per_rank: dict[int, dict], *,
             backend: str, device: str, hosts: int) -> dict:
    """Rank 0: provenance and metrics of one point from every rank's measurements."""
    wl = prep.workloads[(point.transport, point.bucket_bytes)]
    rows = [t for d in per_rank.values() for it in d["iterations"] for t in it["transfers"]]
    cuda = device.startswith("cuda")
    then = " + torch.cuda.synchronize" if cuda else ""
    sync_points = [f"world barrier{then} before each iteration", f"go/done barriers{then} per engine group",
                   f"blocking wait{then} per transfer completion"]
    prov = Provenance(backend=backend, device=device, clock_domain="host" if hosts == 1 else "rank",
                      hosts=hosts, sync_points=tuple(sync_points),
                      device_syncs=sum(d["device_syncs"] for d in per_rank.values()),
                      timed_transfers=len(rows),
                      unsynced_transfers=sum(1 for t in rows if not t[5]) if cuda else 0,
                      incomplete_transfers=sum(1 for t in rows if t[4] is None),
                      warmup_asked=cfg.warmup, warmup_done=min(d["warmup"] for d in per_rank.values()),
                      iters_asked=cfg.iters,
                      iters_measured=min(len(d["iterations"]) for d in per_rank.values()),
                      torch=torch.__version__)
    waves = prep.waves[point]
    credits = prep.credits[point]
    out = {"label": point.label(), "point": asdict(point), "workload": wl.describe(),
           "waves": [list(w) for w in waves.waves], "bound_groups": waves.bound,
           "effective_credits": credits, "inflight_bound_bytes": credits * wl.max_message_bytes,
           "provenance": prov.to_json(), "metrics": None,
           "pool_allocated_bytes": {r: d["pool_allocated_bytes"] for r, d in per_rank.items()}}
    if prov.incomplete_transfers or prov.iters_measured == 0:
        return out  # report.build refuses it
    iters = [iteration_metrics({r: d["iterations"][i] for r, d in per_rank.items()}, shared_clock=hosts == 1)
             for i in range(prov.iters_measured)]
    out["metrics"] = aggregate(iters)
    keep = ("t0", "transfers", "control")
    out["traces"] = [{r: {k: d["iterations"][i][k] for k in keep} for r, d in per_rank.items()}
                     for i in range(prov.iters_measured)]
    return out


def _progress(i: int, n: int, label: str) -> None:
    width = 24
    filled = width * i // n
    line = f"bench [{'#' * filled}{'.' * (width - filled)}] {i}/{n} {label}"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line[:160].ljust(160) + ("\n" if i == n else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def run_sweep(rank: int, world_size: int, cfg: BenchConfig, rdv: Rendezvous, *,
              host_store: bool = True, local_rank: int | None = None,
              prep: Prepared | None = None) -> list[dict] | None:
    """Run every point of the sweep on this rank; rank 0 returns the evaluated results."""
    prep = prep if prep is not None else prepare(cfg, world_size)
    device = resolve_device(cfg.device, rank if local_rank is None else local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = open_store(rdv, is_master=host_store and rank == 0)
    kv = dist.PrefixStore(f"{rdv.name}/bench", store)
    group = SyncGroup(rdv, rank, prep.layout.subgroups(), secret=load_secret().value, store=store, device=device)
    results: list[dict] = []
    try:
        kv.set(f"host/{rank}", socket.gethostname())
        hosts = len({kv.get(f"host/{r}") for r in range(world_size)}) if rank == 0 else 0
        for i, point in enumerate(prep.points):
            mine = _run_point(cfg, prep, point, rank, group, device)
            if rank != 0:
                kv.set(f"{i}/{rank}", json.dumps(mine))
                continue
            per_rank = {0: mine}
            for r in range(1, world_size):
                per_rank[r] = json.loads(kv.get(f"{i}/{r}"))
                kv.delete_key(f"{i}/{r}")
            res = evaluate(cfg, prep, point, per_rank, backend=rdv.backend, device=str(device), hosts=hosts)
            results.append(res)
            if res["metrics"] is not None:
                m = res["metrics"]
                log.info("[rank 0] %s: p50 %.2f ms, %.3f GB/s, groups %d/%d", point.label(),
                         m["latency_s"]["p50"] * 1e3, m["gb_per_s"], m["max_active_groups"], res["bound_groups"])
            if cfg.progress:
                _progress(i + 1, len(prep.points), point.label())
        group.barrier()  # rank 0 has read every key before the store goes away
    finally:
        group.close()
    return results if rank == 0 else None


def environment(backend: str, device: str, world_size: int) -> dict:
    return {"backend": backend, "device": device, "world_size": world_size, "clock": CLOCK,
            "torch": torch.__version__, "host": socket.gethostname(), "cpus": os.cpu_count(),
            "torch_threads_per_rank": torch.get_num_threads()}


def finish(cfg: BenchConfig, prep: Prepared, results: list[dict], env: dict) -> int:
    """Rank 0: refuse unprovable timings, else print the table and write the report."""
    try:
        rep = report.build(cfg, prep.layout, results, env)
    except ProvenanceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3
    print(report.table(rep))
    if cfg.out:
        report.write_json(rep, cfg.out, with_traces=cfg.trace)
        print(f"wrote {cfg.out}")
    if cfg.plots:
        for path in report.plot(rep, cfg.plots):
            print(f"wrote {path}")
    return 0


def _child(rank: int, world_size: int, cfg: BenchConfig, rdv: Rendezvous) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[bench rank {rank}] %(name)s: %(message)s")
    prep = prepare(cfg, world_size)
    results = run_sweep(rank, world_size, cfg, rdv, prep=prep)
    if rank == 0:
        device = str(resolve_device(cfg.device, 0))
        code = finish(cfg, prep, results or [], environment(rdv.backend, device, world_size))
        sys.stdout.flush()
        if code:
            sys.exit(code)




def _spawn(cfg: BenchConfig) -> int:
    world = cfg.nproc or DEFAULT_NPROC
    prepare(cfg, world)
    device = resolve_device(cfg.device, 0)
    if device.type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"--nproc {world} needs one GPU per rank (NCCL refuses two ranks on one GPU); "
                         f"{torch.cuda.device_count()} visible; use torchrun across hosts or --device cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    rdv = Rendezvous("127.0.0.1", free_port(), world, f"bench-{os.getpid()}", backend, cfg.timeout_s)
    ctx = worker_context()
    procs = [ctx.Process(target=_child, args=(r, world, cfg, rdv)) for r in range(world)]
    start_all(procs, threads=1)
    try:
        while any(p.exitcode is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                # rank 0 exits non-zero after the last barrier when it refuses to report
                if failed != [0]:
                    print(f"error: bench rank(s) {failed} failed; see their output above", file=sys.stderr)
                return procs[0].exitcode or 1
            time.sleep(0.2)
        return procs[0].exitcode or max(p.exitcode or 0 for p in procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)


def _torchrun(cfg: BenchConfig) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cfg.nproc is not None and cfg.nproc != world:
        raise ValueError(f"--nproc {cfg.nproc} but torchrun started WORLD_SIZE={world}; leave --nproc out")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = resolve_device(cfg.device, local)
    backend = "nccl" if device.type == "cuda" else "gloo"
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    name = f"bench-{run_id}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    rdv = Rendezvous(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), world,
                     name, backend, cfg.timeout_s)
    logging.basicConfig(level=logging.WARNING, format=f"[bench rank {rank}] %(name)s: %(message)s")
    prep = prepare(cfg, world)
    results = run_sweep(rank, world, cfg, rdv, host_store=not agent_store, local_rank=local, prep=prep)
    if rank != 0:
        return 0
    return finish(cfg, prep, results or [], environment(backend, str(device), world))


def main(cfg: BenchConfig) -> int:
    """Run under torchrun when RANK/WORLD_SIZE are set, else spawn ``cfg.nproc`` processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _torchrun(cfg)
    return _spawn(cfg)
