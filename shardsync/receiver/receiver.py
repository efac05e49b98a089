"""``Receiver``: one engine rank's end of a sync, hostable by any engine process.

Call sequence, on every TP rank of the engine, in the same order: ``Receiver(...)`` ->
``join(connect)`` (collective with the trainer ranks: joins the sync group and compiles
every path the connection may use) -> ``receive(mode, args)`` per update (collective over
the sync) -> ``leave()``.  ``pull`` (disk deltas) and ``checksums`` need no connection.
A failed receive leaves the sync group (it is broken after a failed collective); the host
marks its weights stale until a full update.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from shardsync.control.wire import ConnectRequest
from shardsync.dtypes import dtype_name
from shardsync.layout import EngineParallel, engine_layout
from shardsync.layout.base import Layout
from shardsync.mode import Mode
from shardsync.paths import Colocated, Endpoint, Program, UpdateArgs, compile_path, connection_modes, release
from shardsync.paths.disk import DiskApply
from shardsync.piece import RankLayout, addressed
from shardsync.receiver.connect import PUSH_NEEDS_STAGING, topology_from_connect
from shardsync.receiver.destination import Destination
from shardsync.runtime.checksum import BoxKey, piece_checksums
from shardsync.runtime.gated import Gated
from shardsync.runtime.schedule import SyncRanks, broadcast_steps, p2p_steps, subgroups, write_order
from shardsync.runtime.stats import Stats
from shardsync.spec import ModelSpec
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous
from shardsync.transport.colocated.push_receiver import Staging
from shardsync.transport.group import SyncGroup
from shardsync.views import NO_VIEWS, Views
from shardsync.vocab import Ipc

log = logging.getLogger(__name__)


def engine_rank(spec: ModelSpec, tp_rank: int, tp_size: int, *, dtype_name: str, whole: bool = False, ep: int = 1,
                pp_rank: int = 0, pp: int = 1, variants: frozenset[str] = frozenset(),
                views: Views = NO_VIEWS) -> tuple[Layout, RankLayout]:
    """The engine layout of ``spec`` in ``dtype_name`` and the pieces rank ``(pp_rank, tp_rank)``
    holds (stage-major): what a receiver writes, and what a host checks its parameters against
    (``views``: what the engine serves, e.g. an adapter's tensors alone)."""
    par = EngineParallel(tp=tp_size, ep=ep, pp=pp, dtype=dtype_name, whole=whole,
                         variants=frozenset() if whole else variants)
    spec = spec.replace(dtype=dtype_name)
    layout = views.engine_base(spec, par, lambda: engine_layout(spec, par))
    return layout, layout.ranks[pp_rank * tp_size + tp_rank]


class Receiver:
    """Built from what the engine knows: its model spec, its TP rank and size, its weight
    dtype and device, and where received bytes go (``Destination``)."""

    def __init__(self, spec: ModelSpec, tp_rank: int, tp_size: int, destination: Destination, *,
                 dtype: torch.dtype, device: torch.device | str = "cpu", secret: str,
                 whole: bool = False, ep: int = 1, pp_rank: int = 0, pp: int = 1,
                 variants: frozenset[str] = frozenset(), views: Views = NO_VIEWS) -> None:
        self.spec, self.tp_rank, self.tp_size, self.whole, self.ep = spec, tp_rank, tp_size, whole, ep
        # what this rank serves (an FP8 format: plans carry those weights quantized; an adapter: it
        # joins syncs of that adapter only); the trainer composes the same views from its facts
        self.views = views
        self.pp_rank, self.pp = pp_rank, pp
        self.index = pp_rank * tp_size + tp_rank  # this rank among the engine's (stage-major)
        self.destination = destination
        self._secret = secret  # the trainer signs the store values this rank acts on
        self.dtype, self.device = dtype, torch.device(device)
        self.dtype_name = dtype_name(dtype)
        self.layout, self.rank_layout = engine_rank(spec, tp_rank, tp_size, dtype_name=self.dtype_name, whole=whole,
                                                    ep=ep, pp_rank=pp_rank, pp=pp, variants=variants, views=views)
        self._meta = {t.name: t for t in self.rank_layout.tensors}
        self._views: dict[int, tuple[object, Mapping[str, torch.Tensor]]] = {}  # id(mapping) -> views
        self.group: SyncGroup | None = None
        self.programs: dict[Mode, Program] = {}
        self.check_dtypes: dict[str, str] = {}
        self._disk = DiskApply(self.rank_layout)
        self.sync_rank: int | None = None

    def _tensors(self) -> Mapping[str, torch.Tensor]:
        return self._addressed(self.destination.tensors())

    def _addressed(self, src: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """``src`` as the views the layout addresses (3-D expert stacks as 2-D), built once per
        mapping (a staged destination alternates two), not once per update."""
        hit = self._views.get(id(src))
        if hit is None or hit[0] is not src:
            meta = self._meta

            def view(n: str, t: torch.Tensor) -> torch.Tensor:
                return addressed(t, meta[n]) if n in meta else t

            if len(self._views) >= 3:  # served + two staging sets
                self._views.pop(next(iter(self._views)))
            hit = (src, src.mapped(view) if isinstance(src, Gated) else {n: view(n, t) for n, t in src.items()})
            self._views[id(src)] = hit
        return hit[1]

    @property
    def connected(self) -> bool:
        return self.group is not None

    def join(self, req: ConnectRequest) -> int:
        """Join the sync group ``req`` names (blocks, bounded, until every member is in);
        returns this rank's sync rank.  A join that fails leaves the current connection as
        it was and releases what it built."""
        refused = self.views.mismatch(req.lora)
        if refused is not None:
            raise ValueError(refused)
        topo = topology_from_connect(req, self.dtype_name, self.views)
        if topo.engines[req.engine_index].whole != self.whole:
            raise ValueError(f"the trainer planned {'whole' if not self.whole else 'sharded'} tensors for this "
                             f"engine, this receiver holds {'whole' if self.whole else 'sharded'} ones")
        me = topo.trainer.world_size + topo.engine_rank_offset(req.engine_index) + self.index
        before = self.layout, self.rank_layout, self.check_dtypes
        try:
            return self._join(req, topo, me)
        except Exception:
            self._bind(*before)
            raise

    def _bind(self, layout: Layout, rank_layout: RankLayout, check_dtypes: dict[str, str]) -> None:
        """Address the destination as a connection's layout does (an FP8 engine's tensors hold
        e4m3 words where its plans carry them quantized)."""
        self.layout, self.rank_layout, self.check_dtypes = layout, rank_layout, check_dtypes
        self._meta = {t.name: t for t in rank_layout.tensors}
        self._views.clear()
        self._disk = DiskApply(rank_layout)
        self.destination.bind(rank_layout)

    def _join(self, req: ConnectRequest, topo, me: int) -> int:
        lay = topo.engine_layouts[req.engine_index]
        # the tensors checked in their own (or the engine's) dtype
        self._bind(lay, lay.ranks[self.index], topo.check_dtypes)
        # the paths this connection compiles, derived as the trainer derived them
        modes = connection_modes(Mode.P2P if Mode.P2P.value in req.fingerprints else Mode.BROADCAST, req.delta)
        full = [m for m in modes if not m.is_delta]
        self._plan_window(topo, me, req, full)
        staging = self._staging() if req.ipc is Ipc.PUSH else None  # refused before the group is joined
        rdv = Rendezvous(**req.rendezvous.model_dump())
        # gloo groups carry CPU tensors (signals, CPU data); NCCL groups the weights' device.
        group = SyncGroup(rdv, me, subgroups(topo), secret=self._secret,
                          device=self.device if rdv.backend == "nccl" else None, who=SyncRanks(topo).describe,
                          heartbeat=Keys(rdv.name).alive(req.engine_index, self.index))
        ep = Endpoint(topo, me, group, req.bucket_bytes, req.credits, self.device, verify=req.verify,
                      secret=self._secret, tensors=self._tensors(), rank_layout=self.rank_layout,
                      colocated=None if req.ipc is None else Colocated(ipc=req.ipc, staging=staging))
        programs: dict[Mode, Program] = {}
        try:
            for m in modes:
                if m.over_group:  # disk deltas are pulled (``pull``), not received
                    programs[m] = compile_path(m, ep)
        except Exception:
            release(programs, group)
            raise
        self.leave()
        self.group, self.programs, self.sync_rank = group, programs, me
        return me

    @property
    def unpushable(self) -> str | None:
        """Where this rank receives, if a pushing trainer cannot write it (None: it can)."""
        return self.destination.unpushable()

    def _staging(self) -> Staging:
        """What a pushing trainer writes: the destination's staging sets, as the layout addresses them."""
        dest = self.destination.staged()
        if dest is None or self.unpushable is not None:
            raise ValueError(PUSH_NEEDS_STAGING.format(where=self.unpushable))
        return Staging(sets=[self._addressed(self.destination.pushed(s)) for s in dest.sets()],
                       index=lambda: dest.staging_index,
                       ready_at=dest.ready_at, fence=dest.fence)

    def _plan_window(self, topo, me: int, req: ConnectRequest, full: list[Mode]) -> None:
        """A staging window holds the tensors this connection's receive writes first."""
        staged = self.destination.staged()
        if staged is None or not full:
            return
        if full[0] is Mode.P2P:  # the steps are cached: the program compiled next finds them again
            steps = p2p_steps(topo, me, req.bucket_bytes)
        else:
            steps = tuple(s for st in range(topo.trainer.pp) for s in broadcast_steps(topo, me, req.bucket_bytes, st))
        staged.plan_window(write_order(steps))

    def receive(self, mode: Mode, args: UpdateArgs | None = None, *, commit: bool = True) -> Stats:
        """One update into the destination (collective over the sync).  ``commit=False``: the
        host commits later (a staged receive made while serving)."""
        program = self.programs.get(mode)
        if program is None:
            raise RuntimeError(f"not connected for {mode} (have {sorted(m.value for m in self.programs)})")
        try:
            self.destination.prepare(overwrites=program.overwrites)
            stats = program.run(self._tensors(), args or UpdateArgs())
            t0 = time.perf_counter()
            stats.derived_changed += self.destination.received()
            stats.derive_s += time.perf_counter() - t0
            if commit:
                self.commit()
        except Exception as e:
            log.warning("tp%d: receive (%s) failed: %s", self.tp_rank, mode, e)
            self.destination.discard()
            self.leave()
            raise
        return stats

    def refuse(self, mode: Mode) -> None:
        """Answer an update the host refused whose signal is already on its way (a program
        with ``answers_refusals``); the weights are not touched.  A failure leaves the group."""
        program = self.programs.get(mode)
        if program is None or not program.answers_refusals:
            return  # the trainer waits for the refusal before it sends anything
        try:
            program.refuse()
        except Exception as e:
            log.warning("tp%d: answering a refused update failed: %s", self.tp_rank, e)
            self.leave()
            raise

    def pull(self, root: str | None, version: int, base_version: int | None, *, commit: bool = True) -> Stats:
        """Apply a disk delta published under ``root`` (this rank's parts only).  ``root`` and
        ``base_version`` go to ``UpdateArgs`` as they come; the disk path refuses a missing one."""
        try:
            self.destination.prepare()
            stats = self._disk.run(self._tensors(),
                                   UpdateArgs(version=version, base_version=base_version, root=root))
            t0 = time.perf_counter()
            stats.derived_changed += self.destination.received()
            stats.derive_s += time.perf_counter() - t0
        except Exception:
            self.destination.discard()
            raise
        if commit:
            self.commit()
        return stats

    def commit(self) -> None:
        """Make a receive made with ``commit=False`` the engine's weights; programs that write
        from another process learn where the next receive lands (``committed``)."""
        self.destination.commit()
        for program in self.programs.values():
            program.committed()

    def checksums(self) -> dict[BoxKey, int]:
        """Bitwise checksums of the pieces this rank serves (``runtime.checksum``).  The served
        mapping is one dict whose parameters a staged commit rebinds to other storages: its
        addressed views are made now, never cached (a cached 2-D view of a 3-D expert stack
        would read the storage served before the last swap).  A tensor the destination calls
        ``stale`` gets an impossible sum (-1) in each of its boxes: the comparison fails there."""
        meta = self._meta
        served = {n: addressed(t, meta[n]) if n in meta else t for n, t in self.destination.served().items()}
        sums = piece_checksums(self.rank_layout, served, self.layout.logical, self.dtype, self.check_dtypes)
        stale = self.destination.stale()
        if stale:
            for p in self.rank_layout.pieces:
                if p.local in stale:
                    sums[(p.logical, p.offsets, p.sizes)] = -1
        return sums

    def leave(self) -> None:
        """Leave the sync group and release any mapped trainer memory (weights are kept)."""
        release(self.programs, self.group)
        self.group, self.sync_rank = None, None

