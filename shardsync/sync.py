"""The trainer side of a sync: ``WeightSync`` on every trainer rank.

Call sequence (every trainer rank, same order): ``WeightSync(...)`` -> ``connect()`` once
-> ``update(version)`` after each optimizer step -> optionally ``verify()`` -> ``close()``.
Trainer rank 0 alone talks to the engines (``control.client``): O(1) calls per update; the
other ranks learn each decision through the sync group's store, as typed JSON.  Parameters
are read in place (no copy of the model).
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from shardsync.config import SyncConfig
from shardsync.connection import Connection, agree
from shardsync.control import ranks
from shardsync.control.client import EngineClient, SyncError, UpdateChannel
from shardsync.control.connect import decide, engine_client, rendezvous_of
from shardsync.control.wire import BeginRequest, Decision, Done, Go, Note, RankSums, Verdict
from shardsync.delta.transfer import Snapshot
from shardsync.dtypes import torch_dtype
from shardsync.layout import Fsdp2Parallel, MegatronParallel
from shardsync.mode import Mode
from shardsync.paths import (
    Colocated,
    DeltaSide,
    Endpoint,
    Program,
    UpdateArgs,
    compile_path,
    release,
)
from shardsync.runtime.checksum import combine, compare, piece_checksums
from shardsync.runtime.quantizer import SourceQuantizer
from shardsync.runtime.record import UpdateRecord, append_jsonl, make_record
from shardsync.runtime.schedule import SyncRanks, subgroups
from shardsync.spec import ModelSpec
from shardsync.store.keys import Keys
from shardsync.store.rendezvous import Rendezvous, free_port, open_store
from shardsync.store.secret import load_secret
from shardsync.topology import Topology
from shardsync.transport import SyncGroup
from shardsync.viewed import deriver
from shardsync.vocab import Completion, Ipc, Refused, Signals

log = logging.getLogger("shardsync")

__all__ = ["SyncConfig", "SyncError", "WeightSync"]

def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


class WeightSync:
    """Pushes one trainer's weights into its engines.

    Every method is collective over the trainer ranks (call it on all of them, in the same
    order).  ``params`` are this rank's local tensors in the Megatron layout of ``parallel``;
    ``engines`` the engines' base URLs.
    """

    def __init__(self, spec: ModelSpec, parallel: MegatronParallel | Fsdp2Parallel, rank: int,
                 params: Mapping[str, torch.Tensor], engines: Sequence[str],
                 config: SyncConfig | None = None, *, trainer_group=None) -> None:
        if parallel.world_size > 1 and trainer_group is None:
            raise ValueError("several trainer ranks need trainer_group (to share the rendezvous "
                             "address at connect); pass the trainer's process group")
        if not engines:
            raise ValueError("no engines given; pass at least one engine URL")
        self.spec, self.parallel, self.rank = spec, parallel, rank
        self.params = params
        self.urls = [u.rstrip("/") for u in engines]
        self.config = config or SyncConfig()
        self.trainer_group = trainer_group
        self.conn: Connection | None = None
        self.group: SyncGroup | None = None
        self.programs: dict[Mode, Program] = {}
        self.plan_s = 0.0
        ctl = self.config.control
        self._secret = load_secret(ctl.token, ctl.token_file).value
        # rank 0's word on an update follows the transfer and its answers from the engines
        word_s = self.config.transport.timeout_s + ctl.http_timeout_s
        self.ranks = ranks.TrainerRanks(rank, parallel.world_size, trainer_group,
                                        datetime.timedelta(seconds=word_s), self._secret)
        self._engines = self._client() if rank == 0 else None
        self._channel: UpdateChannel | None = None
        self._snapshot: Snapshot | None = None
        self._derive: SourceQuantizer | None = None  # what the views derive here (an FP8 engine's words)
        self._local: Mapping[str, torch.Tensor] = params  # what the paths read: params and what _derive derives
        self._synced: int | None = None  # the version every engine got from this connection last
        self._calls = 0  # store keys are per call: a version may be sent twice (resync)

    # -- the connection --

    @property
    def topo(self) -> Topology | None:
        return None if self.conn is None else self.conn.topo

    @property
    def mode(self) -> Mode | None:
        """The full-update path of this connection (None before ``connect``)."""
        return None if self.conn is None else self.conn.mode

    @property
    def modes(self) -> tuple[Mode, ...]:
        return () if self.conn is None else self.conn.modes

    @property
    def fallback_reason(self) -> str | None:
        return None if self.conn is None else self.conn.fallback_reason

    def _live(self) -> tuple[Connection, SyncGroup]:
        if self.conn is None or self.group is None:
            raise SyncError("not connected; call connect() first")
        return self.conn, self.group

    @property
    def _lead(self) -> EngineClient:
        """Rank 0's engine client (only rank 0 talks to the engines)."""
        if self._engines is None:
            raise SyncError(f"trainer rank {self.rank} asked the engines; only rank 0 talks to them")
        return self._engines

    @property
    def _lead_channel(self) -> UpdateChannel:
        if self._channel is None:
            raise SyncError("no update channel; call connect() first (on rank 0)")
        return self._channel

    # -- helpers --

    @property
    def source(self) -> str:
        """Where updates read the trainer's weights: ``device`` (GPU-resident), or ``host`` /
        ``host-pinned`` (offloaded to CPU memory: a GPU engine's copies are H2D)."""
        t = next(iter(self.params.values()), None)
        if t is None or t.is_cuda:
            return "device"
        return "host-pinned" if torch.cuda.is_available() and t.is_pinned() else "host"

    def _client(self) -> EngineClient:
        ctl = self.config.control
        return engine_client(ctl.channel, self.urls, ctl.http_timeout_s, self._secret, crossing=ctl.crossing,
                             update_timeout_s=self.config.transport.timeout_s + ctl.http_timeout_s,
                             lora=self.config.lora)

    # -- connect --

    def connect(self) -> None:
        """Agree on engines and paths, join the sync group, compile every path once.

        Named steps, each collective over the trainer ranks: ``decide`` (rank 0 reads the
        engines' facts and picks the rendezvous, ``control.connect``), ``connection.agree`` (plan the connection's
        paths and offer them; an engine whose parameters are not shardsync's layout refuses,
        and the plan falls back to whole tensors by broadcast), ``_join`` (the sync group and
        every path compiled), then rank 0 opens the update channel."""
        t0 = time.perf_counter()
        t = self.config.transport
        decision = self.ranks.share(self.ranks.lead(lambda: decide(self._lead.info(), port=t.port or free_port(t.host)),
                                           Decision), Decision)
        if decision.error:
            raise SyncError(f"connect failed on trainer rank 0: {decision.error}")
        rdv = rendezvous_of(decision, self.parallel.world_size, host=t.host, backend=t.backend, timeout_s=t.timeout_s)
        keys = Keys(rdv.name)
        store = None
        if self.rank == 0:  # hosted engines answer through the store from their first check on
            store = open_store(rdv, is_master=True)
            self._lead.bind(store, keys)
        self.conn = conn = agree(self.ranks, self._engines, self.config, self.spec, self.parallel, decision, rdv, keys)
        topo = conn.topo
        self.plan_s = time.perf_counter() - t0
        self._derive = deriver(topo, self.rank, self.params, count=self.config.detail)
        self._local = self.params if self._derive is None else self._derive.tensors
        if self.config.delta is not None and (self._snapshot is None or self._snapshot.params is not self._local):
            raw = {p.local: torch_dtype(topo.raw_dtypes[p.logical])
                   for p in topo.trainer_layout.ranks[self.rank].pieces if p.logical in topo.raw_dtypes}
            self._snapshot = Snapshot(self._local, torch_dtype(topo.wire_dtype), pin=self.config.delta.pin_memory,
                                      raw=raw)
        if self.rank == 0:
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(self._lead.join)
                self._join(conn, rdv, store)
                joined.result()
            self._channel = self._lead.channel()
        else:
            self._join(conn, rdv, open_store(rdv, is_master=False))
        self._synced = None  # a (re)connected engine set starts with a full update
        self._calls = 0
        if self.rank == 0:
            if conn.fallback_reason:
                log.info("[rank 0] mode=auto falls back to broadcast: %s", conn.fallback_reason)
            log.info("[rank 0] connected %d engine(s) TP %s, mode=%s, plan+connect %.3fs",
                     len(self.urls), decision.tps, conn.mode, time.perf_counter() - t0)
            if conn.topo.unsent_bytes:
                log.info("[rank 0] %.2f MiB of the trainer's tensors are held by no engine and stay (MTP layers: "
                         "engines' serving models hold none)", conn.topo.unsent_bytes / 2**20)

    def _join(self, conn: Connection, rdv: Rendezvous, store) -> None:
        """Build the sync group with the engines, then compile every path of the connection
        (colocated IPC exports here, before the engines' join returns: they map at join)."""
        topo = conn.topo
        self.group = SyncGroup(rdv, self.rank, subgroups(topo), secret=self._secret, store=store,
                               who=SyncRanks(topo).describe)
        cfg = self.config
        device = next(iter(self.params.values())).device  # buffers live where the weights do
        co = cfg.colocated
        ep = Endpoint(topo, self.rank, self.group, cfg.transport.bucket_bytes, cfg.transport.credits, device,
                      detail=cfg.detail, verify=cfg.transport.verify_buckets, secret=self._secret, tensors=self._local,
                      colocated=None if co is None else Colocated(ipc=co.ipc, stream=co.complete is Completion.STREAM,
                                                                  mailbox=co.signals is Signals.MAILBOX,
                                                                  producer=self._derive if co.ipc is Ipc.PUSH
                                                                  else None),
                      delta=None if self._snapshot is None else DeltaSide(snapshot=self._snapshot,
                                                                          dir=cfg.delta.dir if cfg.delta else None))
        self.programs = {m: compile_path(m, ep) for m in conn.modes}

    def add_engine(self, url: str) -> None:
        """Bring a new engine in while training runs: every engine reconnects in one new sync
        group (plans rebuilt); the next ``update`` is a full update for all."""
        self._drop_group()
        self.urls.append(url.rstrip("/"))
        if self._engines is not None:
            self._engines.close()
            self._engines = self._client()
        self.connect()

    # -- update --

    @property
    def synced_version(self) -> int | None:
        """The version this trainer last synced to every engine (None: the next update is full).
        A delta is sent only when every engine reports exactly this version; setting it (e.g.
        after restoring a checkpoint the engines never saw) makes the next update check again."""
        return self._synced

    @synced_version.setter
    def synced_version(self, version: int | None) -> None:
        self._synced = version

    def _choose(self, conn: Connection, requested: Mode | None) -> Mode:
        """Rank 0: this update's path.  A delta needs every engine on the version synced last."""
        delta = next((m for m in conn.modes if m.is_delta), None)
        snapshot_valid = self._snapshot is not None and self._snapshot.valid
        if requested is not None or delta is None or self._synced is None or not snapshot_valid:
            return requested or conn.mode  # the first sync is always full
        versions = self._lead.versions()
        if any(v.stale or v.weight_version != self._synced for v in versions):
            log.info("[rank 0] delta skipped: engines at versions %s, trainer synced %s; full update",
                     [v.weight_version for v in versions], self._synced)
            return conn.mode
        return delta

    def _begin(self, conn: Connection, version: int, requested: Mode | None) -> Go:
        """Rank 0.  Where the program answers refusals itself and the channel can read the
        answers later, the transfer starts without waiting for them (one round trip less)."""
        mode = self._choose(conn, requested)
        if mode.over_group:
            channel = self._lead_channel
            pipelined = self.programs[mode].answers_refusals and channel.pipelines
            channel.begin(BeginRequest(version=version, mode=mode, fingerprint=conn.topo.fingerprint(
                mode.plan.value), base_version=self._synced if mode.is_delta else None,
                crossing=self.config.control.crossing, pipelined=pipelined))
        return Go(mode=mode)

    def _finish(self, version: int) -> Done:
        try:
            return Done(engines=self._lead_channel.finish(version))
        except Refused as e:
            return Done(error=_error(e), refused=True)

    def update(self, version: int, *, mode: str | Mode | None = None) -> UpdateRecord:
        """Push the current parameters as ``version``.

        ``mode`` overrides the connected path for this update (``"broadcast"`` always works;
        ``"p2p"`` when its preconditions held at connect).  With delta configured, an update
        sends only changed elements when every engine holds the version this trainer synced
        last, and a full update otherwise (first sync, a restarted or stale engine, a missed
        step).  Re-sending the engine's current version is allowed.
        """
        conn, group = self._live()
        requested = Mode(mode) if mode is not None else None
        if requested is not None and (requested not in conn.modes or requested.is_delta):
            raise ValueError(f"mode {mode!r} not available for this connection (have "
                             f"{[m.value for m in conn.modes if not m.is_delta]}"
                             f"{'; ' + conn.fallback_reason if conn.fallback_reason else ''})")
        t0, started_at = time.perf_counter(), time.time()
        self._calls += 1
        n = self._calls
        derive_s, derived = (0.0, 0) if self._derive is None else self._derive.refresh()  # before a push launches
        if Mode.P2P in self.programs and requested in (None, Mode.P2P):
            self.programs[Mode.P2P].launch(self._local)  # push: copies into staging start before the engines hear
        decided = self.ranks.lead(lambda: self._begin(conn, version, requested), Go)
        go = self.ranks.signal(group.store, conn.keys.go(n), decided, Go)
        if go.error or go.mode is None:
            raise SyncError(f"update {version} refused: {go.error}")
        path = go.mode
        args = UpdateArgs(version=version, base_version=self._synced)
        t1 = time.perf_counter()
        error, stats = None, None
        try:
            stats = self.programs[path].run(self._local, args)
            stats.derive_s += derive_s
            stats.derived_changed += derived
        except Exception as e:
            error = _error(e)
        t2 = time.perf_counter()
        if path is Mode.DELTA_DISK:  # files need no receive loop: engines pull once all wrote
            notes = self.ranks.gather(group.store, conn.keys.written(n), Note(error=error), Note)
            done = self.ranks.lead(lambda: self._publish(version, args, notes), Done)
        else:
            done = self.ranks.lead(lambda: self._finish(version), Done)
        done = self.ranks.signal(group.store, conn.keys.done(n), done, Done)
        t3 = time.perf_counter()
        error = "; ".join(e for e in (error, done.error) if e) or None  # ours, and what the engines saw
        record = make_record(version, path, error, stats, done.engines,
                             {"plan": self.plan_s, "control": (t1 - t0 - derive_s) + (t3 - t2), "total": t3 - t0},
                             rank=self.rank, topo=conn.topo, detail=self.config.detail,
                             fallback_reason=conn.fallback_reason if path is Mode.BROADCAST else None,
                             buckets=self.programs[path].buckets, source=self.source, started_at=started_at)
        if self.rank == 0:
            (log.info if record.ok else log.error)("[rank 0] %s", record.summary())
        where = self.config.records_path
        if where and (self.rank == 0 or "{rank}" in where):  # one file per rank when the path says so
            append_jsonl(where.format(rank=self.rank), record)
        if error is not None:
            self._synced = None  # the next update is a full one
            if done.refused:  # rank 0's word, the same on every rank: each message was answered
                raise SyncError(f"update {version} refused: {error}")
            if path.over_group:
                self._drop_group()  # a failed collective breaks the group: reconnect
            raise SyncError(f"update {version} failed: {error}")
        if self._snapshot is not None:
            self._snapshot.refresh()
            self._synced = version
        return record

    def _publish(self, version: int, args: UpdateArgs, notes: list[Note]) -> Done:
        failed = next((x.error for x in notes if x.error), None)
        if failed:
            raise SyncError(f"writing version {version} failed: {failed}")
        root = self.programs[Mode.DELTA_DISK].publish(args)
        return Done(engines=self._lead.pull(root, version))

    # -- verify and close --

    def verify(self) -> list[str]:
        """Logical tensors whose engine checksum differs from this trainer's (bitwise, in the
        engine dtype); an empty list means every engine holds exactly the trainer's weights."""
        conn, group = self._live()
        lay = conn.topo.trainer_layout
        if self._derive is not None:
            self._derive.refresh(every=True)
        mine = piece_checksums(lay.ranks[self.rank], self._local, lay.logical, torch_dtype(conn.topo.wire_dtype),
                               conn.topo.check_dtypes)
        self._calls += 1
        sums = RankSums.of(mine)
        parts = self.ranks.gather(group.store, conn.keys.check(self._calls, "sums"), sums, RankSums)

        def judge() -> Verdict:
            held = conn.topo.engine_held  # the MTP layers no engine holds stay out of the comparison
            expected = {k: v for k, v in combine(p.keyed() for p in parts).items() if k in held}
            bad = []
            for url, res in zip(self.urls, self._lead.checksums(), strict=True):
                got = {k: (None if v is None else int(v)) for k, v in res.checksums.items()}
                bad += [f"{url}: {name}" for name in compare(expected, got)]
            return Verdict(mismatched=bad)

        verdict = self.ranks.lead(judge, lambda error: Verdict(mismatched=[f"verify failed: {error}"]))
        return self.ranks.signal(group.store, conn.keys.check(self._calls, "verdict"), verdict, Verdict).mismatched

    def _drop_group(self) -> None:
        release(self.programs, self.group)
        self.group = None

    def close(self) -> None:
        """Engines leave the sync group (and unmap this trainer's memory) before any trainer
        rank lets go of its tensors."""
        if self.group is not None and self.conn is not None:
            if self._engines is not None:
                try:
                    self._engines.disconnect()
                except Exception as e:  # an engine that is gone needs no goodbye
                    log.debug("disconnect: %s", e)
            try:
                bye = Note() if self.rank == 0 else None
                self.ranks.signal(self.group.store, self.conn.keys.closed(self._calls), bye, Note)
            except Exception as e:
                log.debug("close signal: %s", e)
        self._drop_group()
        if self._engines is not None:
            self._engines.close()
