"""Lower bounds of an update's wire time on a named fabric, from the plans alone.

A path cannot finish before its busiest endpoint has pushed (or taken in) its bytes: for
each rank (or node, where the fabric pools NICs per node) the bound is bytes / bandwidth,
and the path's bound is the largest.  Trainer and engines sit on separate nodes of
``gpus_per_node`` GPUs (trainer ranks first, packed in rank order), so every link crosses
the fabric.  Broadcast is bounded by a receiver taking in the whole model (a pipelined ring
or tree moves each byte into each receiver once).  Compute, packing and latency are not
counted: these are floors to compare with published figures, not predictions of our code.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from shardsync.plan.bucket import make_buckets
from shardsync.topology import Topology

GB = 1e9


@dataclass(frozen=True)
class Fabric:
    name: str
    description: str
    gpu_gbytes_s: float  # per GPU, each direction
    node_gbytes_s: float | None = None  # NICs pooled per node (rail-agnostic), each direction
    gpus_per_node: int = 8
    # for the bucket size (plan/tuning.py): what one message costs beyond its bytes, and how
    # fast a rank packs a bucket (a device copy)
    message_us: float = 20.0
    copy_gbytes_s: float = 2000.0  # the H200's D2D copy: 7.49 GiB in 3.81 ms (docs/gpu.md)


FABRICS: dict[str, Fabric] = {f.name: f for f in (
    Fabric("nvlink4", "NVLink 4 within one node (H100/H200 SXM): 450 GB/s per GPU each way", 450.0),
    Fabric("ib400", "one 400 Gb/s InfiniBand NIC per GPU: 50 GB/s per GPU each way", 50.0, message_us=30.0),
    Fabric("8x400g", "8 x 400 Gb/s NICs per node shared by its 8 GPUs: 400 GB/s per node each way",
           50.0 * 8, node_gbytes_s=400.0, message_us=30.0),
    Fabric("pcie5", "PCIe 5.0 x16 per GPU (NIC or host path): 64 GB/s per GPU each way", 64.0),
    # this repository's CI machine, fitted to `shardsync bench` (docs/tuning.md): gloo on loopback
    Fabric("cpu-gloo", "gloo over loopback on a 2-core CPU VM (fitted, docs/tuning.md)", 1.5,
           gpus_per_node=1 << 20, message_us=700.0, copy_gbytes_s=12.0),
)}


def fabric(name: str) -> Fabric:
    if name not in FABRICS:
        raise ValueError(f"unknown fabric {name!r}; known: {', '.join(FABRICS)}")
    return FABRICS[name]


def _bound(sent: dict[str, int], got: dict[str, int], node_of: Callable[[str], str], f: Fabric) -> tuple[float, str]:
    """(seconds, what binds) for per-endpoint byte counts."""
    if f.node_gbytes_s is None:
        side, rank, b = max([("send", r, b) for r, b in sent.items()] + [("recv", r, b) for r, b in got.items()],
                            key=lambda x: x[2])
        return b / (f.gpu_gbytes_s * GB), f"{side} of {rank}: {b / GB:.2f} GB"
    nodes: dict[tuple[str, str], int] = defaultdict(int)
    for r, b in sent.items():
        nodes[("send", node_of(r))] += b
    for r, b in got.items():
        nodes[("recv", node_of(r))] += b
    (side, node), b = max(nodes.items(), key=lambda kv: kv[1])
    per_gpu = max(list(sent.values()) + list(got.values()))
    t = max(b / (f.node_gbytes_s * GB), per_gpu / (f.gpu_gbytes_s * GB))
    return t, f"{side} of node {node}: {b / GB:.2f} GB"


def lower_bounds(topo: Topology, f: Fabric, bucket_bytes: int) -> list[dict]:
    """Per full-update path: the floor on ``f`` in seconds, what binds it, and the schedule size."""
    trainer_world, g = topo.trainer.world_size, f.gpus_per_node
    trainer_nodes = -(-trainer_world // g)

    def node_of(endpoint: str) -> str:
        kind, i = endpoint.split(":")
        return f"trainer{int(i) // g}" if kind == "t" else f"engine{int(i) // g + trainer_nodes}"

    out = []
    plan = topo.p2p_plan
    sent: dict[str, int] = defaultdict(int)
    got: dict[str, int] = defaultdict(int)
    for (s, d), b in plan.link_bytes.items():
        sent[f"t:{s}"] += b
        got[f"e:{d}"] += b
    t, why = _bound(sent, got, node_of, f)
    out.append({"path": "p2p", "lower_bound_s": t, "binds": why,
                "links": len(plan.link_bytes), "buckets": len(make_buckets(plan, bucket_bytes))})
    bcast = topo.broadcast_plan
    per_receiver = max(bcast.bytes_per_dst().values())
    got = {f"e:{d}": per_receiver for d in range(topo.num_engine_ranks)}
    # each stage source pushes its stage once into the ring / tree
    sent = {f"t:{topo.stage_ranks(s)[0]}": b for (s, d), b in bcast.link_bytes.items() if d == 0}
    t, why = _bound(sent, got, node_of, f)
    buckets = make_buckets(bcast, bucket_bytes, bcast.copies_to(0))
    out.append({"path": "broadcast", "lower_bound_s": t, "binds": why, "links": len(sent), "buckets": len(buckets)})
    return out
