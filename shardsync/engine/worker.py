"""One engine TP worker: the model shard, and the receiving end of a sync.

Workers are driven by commands (plain dicts over in-host queues, never the network) that
worker 0 fans out in one order to every worker; each command is collective over the
engine's TP group or the sync group.  Weight version and staleness live on worker 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from shardsync.delta.transfer import DeltaRunner
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.models.engine import EngineModel
from shardsync.runtime.checksum import piece_checksums
from shardsync.runtime.update import Schedule
from shardsync.spec import ModelSpec
from shardsync.topology import Topology
from shardsync.transport import Rendezvous, SyncGroup

log = logging.getLogger(__name__)


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict[str, Any]) -> ModelSpec:
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = set(d) - fields
    if unknown:
        raise ValueError(f"unknown model spec fields {sorted(unknown)}")
    return ModelSpec(**d)


def topology_from_connect(req: dict[str, Any], dtype: str) -> Topology:
    """The topology a connect request describes, with this engine's wire dtype."""
    spec = spec_from_dict(req["spec"]).replace(dtype=dtype)
    t = dict(req["trainer"])
    if t.get("pp_layers") is not None:
        t["pp_layers"] = tuple(t["pp_layers"])
    trainer = MegatronParallel(**t)
    engines = tuple(EngineParallel(tp=tp, dtype=dtype) for tp in req["engines"])
    return Topology(spec, trainer, engines, relay=bool(req.get("relay", False)))


class EngineWorker:
    def __init__(self, model: EngineModel, rank: int, tp: int) -> None:
        self.model, self.rank, self.tp = model, rank, tp
        for p in model.parameters():
            p.requires_grad_(False)
        self.params = dict(model.named_parameters())
        self.sync: tuple[Topology, Schedule, SyncGroup, int] | None = None
        self.delta: DeltaRunner | None = None
        self.transport = None
        self._pull_targets: dict = {}  # where disk-delta parts land on this rank, kept across pulls

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    # -- commands (each one is called on every worker, in the same order) --

    def generate(self, **kw: Any) -> list:
        return self.model.generate(**kw)

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.model.score(sequences)

    def join(self, req: dict[str, Any]) -> dict[str, Any]:
        """Join the sync group a trainer opened (blocks until every member arrives)."""
        self.disconnect()
        topo = topology_from_connect(req, str(self.model.dtype).removeprefix("torch."))
        offset = topo.engine_rank_offset(req["engine_index"])
        me = topo.trainer.world_size + offset + self.rank
        sched = Schedule(topo, me, req["bucket_bytes"], credits=req["credits"],
                         device=self.model.device)
        for mode in ("p2p", "broadcast"):  # compile once, before the first update
            for stage in range(topo.trainer.pp if mode == "broadcast" else 1):
                sched.steps(mode, stage)
        rdv = Rendezvous(**req["rendezvous"])
        # gloo groups carry CPU tensors (signals, CPU data); NCCL groups the model's device.
        group = SyncGroup(rdv, me, sched.subgroups(),
                          device=self.model.device if rdv.backend == "nccl" else None)
        self.transport = group
        if req.get("ipc") == "slots":
            from shardsync.transport.ipc import IpcTransport

            self.transport = IpcTransport(group, slots=req["credits"])
            for peer in sorted({s.comm[1] for s in sched.steps("p2p") if s.comm[0] == "recv"}):
                self.transport.attach(peer)
        elif req.get("ipc"):  # "map": read the trainer's tensors in place
            from shardsync.transport.mapped import MappedTransport

            self.transport = MappedTransport.for_rank(group, topo, rdv.name)
            for peer in self.transport.peers:
                self.transport.attach(peer, 1, self.params)
        self.sync = (topo, sched, group, req["engine_index"])
        self.delta = DeltaRunner(topo, me, req["bucket_bytes"], credits=req["credits"],
                                 rank=self.model.layout.ranks[self.rank])
        return {"rank": self.rank, "sync_rank": me}

    def update(self, version: int, mode: str) -> dict[str, Any]:
        """Receive one full update into the parameters, in place."""
        if self.sync is None:
            raise RuntimeError("not connected to a trainer")
        topo, sched, group, _ = self.sync
        t0 = time.perf_counter()
        try:
            if mode.startswith("delta-"):
                d = self.delta.run(mode.removeprefix("delta-"), self.params, group)
                return {"ok": True, "pack_s": 0.0, "transfer_s": d.transfer_s, "unpack_s": d.apply_s,
                        "total_s": time.perf_counter() - t0, "bytes_received": d.bytes_received,
                        "changed": d.changed, "buffer_bytes": self.delta.pool.allocated_bytes,
                        "buckets": 0}
            transport = self.transport if mode == "p2p" else group
            stats = sched.run(mode, self.params, transport, barrier=group.barrier)
        except Exception as e:  # the group is broken after a failed collective
            log.warning("tp%d: update %d (%s) failed: %s", self.rank, version, mode, e)
            self.disconnect()
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "pack_s": stats.pack_s, "transfer_s": stats.transfer_s,
                "unpack_s": stats.unpack_s, "total_s": time.perf_counter() - t0,
                "bytes_received": stats.bytes_received, "buffer_bytes": stats.peak_buffer_bytes,
                "buckets": sum(len(sched.steps(mode, s)) for s in
                               range(topo.trainer.pp if mode == "broadcast" else 1))}

    def pull(self, root: str, version: int, current: int) -> dict[str, Any]:
        """Apply delta ``version`` from ``root`` (a shared directory) to this rank's weights."""
        from shardsync.delta.disk import apply_version

        t0 = time.perf_counter()
        try:
            d = apply_version(root, version, current, self.params, self.model.layout.ranks[self.rank],
                              self._pull_targets)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return {"ok": True, "pack_s": 0.0, "transfer_s": 0.0, "unpack_s": d.apply_s,
                "total_s": time.perf_counter() - t0, "bytes_received": d.bytes_received,
                "changed": d.changed, "buffer_bytes": 0, "buckets": 0}

    def checksum(self) -> dict:
        rl = self.model.layout.ranks[self.rank]
        return piece_checksums(rl, self.params, self.model.layout.logical, self.model.dtype)

    def disconnect(self) -> None:
        detach = getattr(self.transport, "detach", None)
        if detach is not None:
            detach()  # release mapped trainer memory
        if self.sync is not None:
            self.sync[2].close()
            self.sync = None

    def handle(self, kind: str, args: dict[str, Any]) -> Any:
        fn = getattr(self, kind, None)
        if kind.startswith("_") or fn is None or not callable(fn) or kind == "handle":
            raise ValueError(f"unknown engine command {kind!r}")
        with torch.no_grad():
            return fn(**args)
