"""``shardsync bench`` flags: comma lists are sweep axes; parsed into a ``BenchConfig``."""

from __future__ import annotations

import argparse

from shardsync.bench.sweep import BenchConfig


def _list(kind):
    def parse(value: str) -> tuple:
        try:
            return tuple(kind(v.strip()) for v in value.split(",") if v.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{value!r}: {e}") from None
    return parse


def _cap(v: str) -> float | None:
    return None if v.lower() in ("none", "inf") else float(v)


def _onoff(v: str) -> bool:
    if v.lower() not in ("on", "off"):
        raise ValueError("use on or off")
    return v.lower() == "on"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default 5; torchrun: WORLD_SIZE)")
    p.add_argument("--trainer-ranks", type=int, default=1, help="ranks that send (the trainer's)")
    p.add_argument("--engine-group-size", type=int, default=None, help="homogeneous engine groups (default 1)")
    p.add_argument("--engine-group-sizes", type=_list(int), default=None,
                   help="heterogeneous groups, e.g. 2,1,4: must cover every non-trainer rank once")
    p.add_argument("--transport", type=_list(str), default=("broadcast", "p2p"), help="broadcast,p2p")
    p.add_argument("--bucket-mb", type=_list(float), default=(1.0,), help="message/bucket MiB, e.g. 0.25,1,4")
    p.add_argument("--messages", type=int, default=4, help="synthetic messages per engine rank")
    p.add_argument("--credits", type=_list(int), default=(2,), help="buffers in flight per rank")
    p.add_argument("--inflight-mb", type=_list(_cap), default=(None,), help="bytes-in-flight cap per rank (none)")
    p.add_argument("--policy", type=_list(str), default=("all_at_once", "windowed", "serialized"),
                   help="engine-wave policies: when each engine group starts receiving")
    p.add_argument("--window", type=_list(int), default=(2,), help="W for windowed (a list sweeps W)")
    p.add_argument("--stride-us", type=_list(float), default=(0.0,), help="delay between engine groups' starts")
    p.add_argument("--reuse", type=_list(_onoff), default=(True,), help="on,off: preallocated buffers or per transfer")
    p.add_argument("--iters", type=int, default=10, help="measured iterations per configuration")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured iterations first")
    p.add_argument("--model", default=None, help="move a real plan's buckets (preset or config.json)")
    p.add_argument("--trainer-tp", type=int, default=None, help="plan trainer TP (default --trainer-ranks)")
    p.add_argument("--engine-tp", type=int, default=None, help="plan engine TP (default: each group's size)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda (cuda: nccl, one GPU per rank)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="every collective and receive")
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--plots", default=None, help="directory for latency.png and inflight.png")
    p.add_argument("--trace", action="store_true", help="keep per-transfer traces in the JSON report")
    p.add_argument("--no-progress", action="store_true", help="no progress line per configuration")


def config_from_args(a: argparse.Namespace) -> BenchConfig:
    return BenchConfig(nproc=a.nproc, trainer_ranks=a.trainer_ranks, engine_group_size=a.engine_group_size,
                       engine_group_sizes=a.engine_group_sizes, transports=a.transport, bucket_mb=a.bucket_mb,
                       messages=a.messages, credits=a.credits, inflight_mb=a.inflight_mb, policies=a.policy,
                       windows=a.window, stride_us=a.stride_us, reuse=a.reuse, warmup=a.warmup, iters=a.iters,
                       model=a.model, trainer_tp=a.trainer_tp, engine_tp=a.engine_tp, device=a.device,
                       timeout_s=a.timeout_s, trace=a.trace, out=a.out, plots=a.plots,
                       progress=not a.no_progress)
