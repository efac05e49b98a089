"""The demo on a Ray cluster: trainer ranks and engine servers as actors in placement groups.

This is the only module of shardsync that imports ``ray`` (the ``ray`` extra).  What runs
is the same as ``shardsync demo``: engine servers (``shardsync engine serve``, their own TP
worker processes) and Megatron-layout trainer ranks synced by ``WeightSync``; Ray only
places the processes and hands out the addresses they meet at.

Call sequence (driver, ``run_ray``):

1. join or start the cluster, wait for ``min_nodes`` nodes;
2. reserve two placement groups: one bundle per trainer rank (1 CPU, plus 1 GPU when the
   cluster has GPUs) and one bundle per engine (``tp`` CPUs, plus ``tp`` GPUs); bundles are
   packed, so TP neighbours share a node when they fit;
3. every engine actor picks a free port on its node, starts the server bound to its node's
   IP (``ray.util.get_node_ip_address()``) and reports its URL once healthy;
4. trainer rank 0's actor picks a free port on its node for the trainer's default group;
   the sync rendezvous (a TCPStore, port picked at connect) is hosted on the same IP;
5. every trainer actor runs ``shardsync.launch.loop.trainer_rank``; rank 0 streams one
   result per step back to the driver, which prints the demo's table and writes its files;
6. engines stopped, actors killed, placement groups removed (also on failure).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from shardsync.control.client import wait_healthy
from shardsync.demo import DemoConfig, report
from shardsync.engine.launch import EngineConfig, spawn_server
from shardsync.launch.loop import RankSite, StepResult, trainer_rank
from shardsync.runtime.record import append_jsonl
from shardsync.store import free_port
from shardsync.store.secret import ENV_TOKEN, load_secret


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """How the demo is placed on Ray.

    ``address``: ``None`` starts a local cluster unless ``ray.init`` already ran in this
    process; ``"auto"`` or ``"HOST:PORT"`` joins a running cluster.  ``gpus``: GPU bundles
    (``None``: when the cluster has a GPU for every rank; the reference models compute on CPU
    either way, the bundles reserve what a GPU trainer and engine would hold).
    ``min_nodes``: nodes to wait for before placing.  ``verify=False`` skips the bitwise
    checksum after each update.  ``delta_dir``: where delta over disk publishes (default
    ``<out>/versions``; on several nodes, a directory every node mounts).
    """

    address: str | None = None
    gpus: bool | None = None
    min_nodes: int = 1
    verify: bool = True
    ready_timeout_s: float = 300.0
    delta_dir: str | None = None


def node_ip() -> str:
    return ray.util.get_node_ip_address()




def bundles(cfg: DemoConfig, *, gpus: bool) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """(trainer bundles, engine bundles): one per trainer rank, one per engine."""
    world = cfg.trainer.world_size
    trainer = [{"CPU": 1.0, "GPU": 1.0} if gpus else {"CPU": 1.0} for _ in range(world)]
    engines = [{"CPU": float(tp), "GPU": float(tp)} if gpus else {"CPU": float(tp)}
               for tp in cfg.engine_tp]
    return trainer, engines


def _die_with_parent() -> None:
    # An engine must not outlive its actor (ray.kill sends SIGKILL, which nothing can trap).
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineServer:
    """Actor: one engine server (its own TP worker processes) on this actor's node."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> str:
        """Start the server on a free port of this node; return its URL once healthy."""
        ip = node_ip()
        cfg = dataclasses.replace(self.cfg, host=ip, port=free_port(ip))
        self.proc, url = spawn_server(cfg, preexec_fn=_die_with_parent)
        wait_healthy(url, self.proc, timeout_s)
        return url

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(5)


class TrainerRank:
    """Actor: one trainer rank; ``run`` streams rank 0's per-step results."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def address(self) -> tuple[str, int]:
        """This node's IP and a port free on it (rank 0: the trainer's default group)."""
        ip = node_ip()
        return ip, free_port(ip)

    def run(self, cfg: DemoConfig, where: RankSite, verify: bool) -> Iterator[StepResult]:
        for result in trainer_rank(cfg, where, verify=verify):
            if self.rank == 0:
                yield result


def _wait_for_nodes(n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while (alive := sum(1 for node in ray.nodes() if node["Alive"])) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {alive} of {n} Ray nodes joined within {timeout_s:.0f}s; "
                               "start the workers with `ray start --address HEAD_IP:PORT`")
        print(f"waiting for Ray nodes: {alive}/{n}", flush=True)
        time.sleep(5)


def _totals(resources: dict[str, float]) -> dict[str, float]:
    return {k: resources.get(k, 0.0) for k in ("CPU", "GPU")}


def _check_fits(*bundle_lists: list[dict[str, float]]) -> None:
    """Refuse at once what the cluster can never hold (per-node fit is Ray's to decide)."""
    have = _totals(ray.cluster_resources())
    need = {k: sum(b.get(k, 0.0) for bl in bundle_lists for b in bl) for k in have}
    short = {k: (need[k], have[k]) for k in need if need[k] > have[k]}
    if short:
        raise ValueError("the cluster is too small for this topology: " + ", ".join(
            f"{k} needed {n:g}, cluster has {h:g}" for k, (n, h) in short.items())
            + "; add nodes, or start Ray with more logical CPUs (ray start --num-cpus N)")


def _reserve(bundle_list: list[dict[str, float]], name: str, timeout_s: float) -> PlacementGroup:
    pg = placement_group(bundle_list, strategy="PACK", name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise TimeoutError(f"Ray could not place {name} bundles {bundle_list} within {timeout_s:.0f}s "
                           f"(cluster: {_totals(ray.cluster_resources())}, free now: "
                           f"{_totals(ray.available_resources())})") from None
    return pg


def _in(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _results(gens: list, deadline: float) -> Iterator[StepResult]:
    """Rank 0's results as they come, failing fast when any rank's task fails."""
    pending = list(gens)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=5)
        if not ready and time.monotonic() > deadline:
            raise TimeoutError("the trainer ranks did not finish in time")
        for gen in ready:
            try:
                ref = next(gen)  # type: ignore[arg-type]  # ray.wait hands back the generators it was given
            except StopIteration:
                continue
            yield ray.get(ref)  # raises the rank's error
            pending.append(gen)


def _use_gpus(cfg: DemoConfig, rc: RayConfig) -> bool:
    if rc.gpus is not None:
        return rc.gpus
    have = ray.cluster_resources().get("GPU", 0.0)
    need = cfg.trainer.world_size + sum(cfg.engine_tp)
    if 0 < have < need:
        print(f"note: the cluster has {have:g} GPUs, the topology needs {need}; CPU bundles", flush=True)
    return have >= need


def _actors(cfg: DemoConfig, pgs: list[PlacementGroup], gpus: bool, delta_root: str) -> tuple[list, list]:
    """(engine actors, trainer actors), each pinned to its bundle.  Engines listen on their
    node's address: every actor gets one run's shared secret (the user's, or a fresh one)."""
    given = load_secret()
    token = given.value if given.given else secrets.token_hex(32)  # actors may run on other machines
    env = {"runtime_env": {"env_vars": {ENV_TOKEN: token}}}
    engine_actor, trainer_actor = ray.remote(EngineServer), ray.remote(TrainerRank)
    engines = [engine_actor.options(num_cpus=tp, num_gpus=tp if gpus else 0, scheduling_strategy=_in(pgs[1], i),
                                    **env)
               .remote(cfg.engine_config(tp, delta_root=delta_root))
               for i, tp in enumerate(cfg.engine_tp)]
    trainers = [trainer_actor.options(num_cpus=1, num_gpus=1 if gpus else 0, scheduling_strategy=_in(pgs[0], r),
                                      **env)
                .remote(r) for r in range(cfg.trainer.world_size)]
    return engines, trainers


def _release(engines: list, actors: list, pgs: list[PlacementGroup]) -> None:
    for e in engines:
        try:
            ray.get(e.stop.remote(), timeout=30)
        except Exception:  # a dead actor took its engine with it (PDEATHSIG)
            pass
    for a in actors:
        ray.kill(a)
    for pg in pgs:
        remove_placement_group(pg)


def _run(cfg: DemoConfig, rc: RayConfig) -> int:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "records.jsonl").unlink(missing_ok=True)
    _wait_for_nodes(rc.min_nodes, rc.ready_timeout_s)
    gpus = _use_gpus(cfg, rc)
    trainer_b, engine_b = bundles(cfg, gpus=gpus)
    _check_fits(trainer_b, engine_b)
    pgs = [_reserve(trainer_b, "shardsync-trainer", rc.ready_timeout_s)]
    engines: list = []
    trainers: list = []
    rows: list[dict] = []
    modes: list[str] = cfg.modes
    try:
        pgs.append(_reserve(engine_b, "shardsync-engines", rc.ready_timeout_s))
        delta_dir = rc.delta_dir or str(out.resolve() / "versions")
        engines, trainers = _actors(cfg, pgs, gpus, delta_dir)
        urls = ray.get([e.start.remote(cfg.timeout_s) for e in engines], timeout=cfg.timeout_s + 60)
        ip, port = ray.get(trainers[0].address.remote(), timeout=cfg.timeout_s)
        print(f"shardsync demo on Ray ({'GPU' if gpus else 'CPU'} bundles): {cfg.model}, trainer "
              f"TP{cfg.trainer_tp} PP{cfg.trainer_pp} (rank 0 at {ip}) -> engines {urls}, "
              f"{cfg.steps} GRPO steps, modes {cfg.modes}", flush=True)
        gens = [t.run.remote(cfg, RankSite(rank=r, init_method=f"tcp://{ip}:{port}", sync_host=ip,
                                           engines=tuple(urls), delta_dir=delta_dir), rc.verify)
                for r, t in enumerate(trainers)]
        for result in _results(gens, time.monotonic() + cfg.timeout_s * (cfg.steps + 2)):
            if not rows:
                modes = list(result.modes)
                print(report.header(modes))
            print(report.row(result.row, modes), flush=True)
            rows.append(result.row)
            for rec in result.records:
                append_jsonl(out / "records.jsonl", rec)
    finally:
        _release(engines, engines + trainers, pgs)
    summary = report.summary(rows, modes)  # checksum_ok None reads "skipped"
    print("\n".join(summary))
    (out / "steps.json").write_text(json.dumps(
        {"config": dataclasses.asdict(cfg), "launcher": "ray", "gpu_bundles": gpus, "steps": rows},
        indent=2))
    report.plot(rows, modes, out / "demo.png")
    print(f"wrote {out / 'records.jsonl'}, {out / 'steps.json'}, {out / 'demo.png'}")
    return int(any(u["checksum_ok"] is False for r in rows for u in r["updates"].values()))


def run_ray(cfg: DemoConfig, ray_config: RayConfig | None = None) -> int:
    """Run the demo with Ray placing every process; returns the exit code (0: every update
    ok and, unless skipped, bitwise verified).  Shuts Ray down only if it started it."""
    rc = ray_config or RayConfig()
    if cfg.ipc:
        print("error: ipc needs trainer and engine processes that address the same GPUs; Ray gives each "
              "actor its own CUDA_VISIBLE_DEVICES: run with --no-ipc or the local launcher", file=sys.stderr)
        return 2
    cfg = dataclasses.replace(cfg, ipc=False)  # --device cuda alone: p2p over the sync group
    started = not ray.is_initialized()
    if started:
        if rc.address is None:  # a local cluster: logical CPUs enough for every bundle
            cpus = sum(b["CPU"] for bl in bundles(cfg, gpus=False) for b in bl)
            ray.init(address="local", num_cpus=max(int(cpus), os.cpu_count() or 1),
                     include_dashboard=False)
        else:
            ray.init(address=rc.address)
    try:
        return _run(cfg, rc)
    except Exception as e:
        print(f"demo on Ray failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    finally:
        if started:
            ray.shutdown()
