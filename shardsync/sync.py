"""The trainer side of a sync: ``WeightSync`` on every trainer rank.

Call sequence (every trainer rank, same order): ``WeightSync(...)`` -> ``connect()`` once
-> ``update(version)`` after each optimizer step -> optionally ``verify()`` -> ``close()``.
Trainer rank 0 alone talks HTTP to the engines: O(1) calls per update (begin, finish);
the other ranks learn the outcome through the sync group's store.  Parameters are read
in place (no copy of the model).
"""

from __future__ import annotations

import datetime
import json
import logging
import pickle
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

from shardsync.delta.disk import DiskPublisher
from shardsync.delta.transfer import DeltaRunner, Snapshot
from shardsync.engine.protocol import ctl_key
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.plan.preconditions import check_p2p
from shardsync.runtime.checksum import combine, compare, piece_checksums
from shardsync.runtime.record import UpdateRecord, append_jsonl
from shardsync.runtime.update import Schedule
from shardsync.spec import ModelSpec
from shardsync.topology import Topology
from shardsync.transport import Rendezvous, SyncGroup
from shardsync.transport.group import free_port, open_store
from shardsync.transport.ipc import IpcTransport
from shardsync.transport.mapped import MappedTransport

log = logging.getLogger("shardsync")
MODES = ("auto", "p2p", "broadcast", "delta")
DELTA_TRANSPORTS = ("p2p", "broadcast", "disk")
IPC_KINDS = ("map", "slots")
CONTROLS = ("store", "http")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    mode: str = "auto"
    bucket_mb: float = 64.0
    credits: int = 2
    timeout_s: float = 60.0
    http_timeout_s: float = 60.0
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    engine_kind: str = "reference"
    engine_pp: int = 1
    quantization: str | None = None
    records_path: str | None = None
    detail: bool = False
    delta_transport: str = "p2p"
    delta_dir: str | None = None
    delta_pin_memory: bool = False
    relay: bool = False
    # engines on the trainer's machine: "map" (or True) reads the trainer's tensors in place
    # (CUDA IPC or CPU shared memory); "slots" stages buckets through exported CUDA buffers
    ipc: bool | str = False
    # begin/finish of each update: "store" (keys in the sync group's store, ~0.2 ms) or "http"
    # (POST /weights/begin and /finish, ~1.5 ms each); connect, verify and disk deltas use HTTP
    control: str = "store"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.delta_transport not in DELTA_TRANSPORTS:
            raise ValueError(f"delta_transport must be one of {DELTA_TRANSPORTS}, got {self.delta_transport!r}")
        if self.control not in CONTROLS:
            raise ValueError(f"control must be one of {CONTROLS}, got {self.control!r}")
        if self.ipc is True:
            object.__setattr__(self, "ipc", "map")
        if self.ipc and self.ipc not in IPC_KINDS:
            raise ValueError(f"ipc must be False or one of {IPC_KINDS}, got {self.ipc!r}")
        if self.ipc and self.mode not in ("auto", "p2p"):
            raise ValueError("ipc moves full p2p updates between processes on one machine; use mode='p2p'")
        if self.ipc and self.relay:
            raise ValueError("ipc lets every engine read the trainer directly; relay is for network links: "
                             "drop one of them")
        if self.relay and self.mode == "delta" and self.delta_transport == "p2p":
            raise ValueError("relay applies to full p2p updates; delta over p2p sends every engine its "
                             "parts directly: use delta_transport='broadcast' or relay=False")
        if self.mode == "delta" and self.delta_transport == "disk" and not self.delta_dir:
            raise ValueError("delta over disk needs delta_dir (a directory every engine can read)")


class SyncError(RuntimeError):
    """An update or connect that did not complete; engines keep (or mark stale) their weights."""




class WeightSync:
    def __init__(self, spec: ModelSpec, parallel: MegatronParallel, rank: int,
                 params: Mapping[str, torch.Tensor], engines: Sequence[str],
                 config: SyncConfig = SyncConfig(), *, trainer_group=None) -> None:
        if parallel.world_size > 1 and trainer_group is None:
            raise ValueError("several trainer ranks need trainer_group (to share the rendezvous "
                             "address at connect); pass the trainer's process group")
        if not engines:
            raise ValueError("no engines given; pass at least one engine URL")
        self.spec, self.parallel, self.rank = spec, parallel, rank
        self.params = params
        self.urls = [u.rstrip("/") for u in engines]
        self.config = config
        self.trainer_group = trainer_group
        self.topo: Topology | None = None
        self.mode: str | None = None
        self.modes: tuple[str, ...] = ()
        self.fallback_reason: str | None = None
        self.group: SyncGroup | None = None
        self._store = None
        self._sched: Schedule | None = None
        self._snapshot: Snapshot | None = None
        self._delta: DeltaRunner | None = None
        self._disk: DiskPublisher | None = None
        self._synced: int | None = None
        self._updates = 0
        self._ctl = 0  # updates begun through the store on this connection (engine counts too)
        self._http = httpx.Client(timeout=config.http_timeout_s) if rank == 0 else None
        self.plan_s = 0.0

    # -- control plane helpers (rank 0) --

    def _call_all(self, method: str, path: str, payloads: Sequence[dict | None] | None = None) -> list[dict]:
        assert self._http is not None
        payloads = payloads or [None] * len(self.urls)

        def one(i: int) -> dict:
            url = self.urls[i] + path
            r = self._http.request(method, url, json=payloads[i])
            if r.status_code >= 400:
                raise SyncError(f"{method} {url} -> {r.status_code}: {r.text[:500]}")
            return r.json()

        if len(self.urls) == 1:  # the common colocated case: no thread hop on the hot path
            return [one(0)]
        with ThreadPoolExecutor(len(self.urls)) as pool:
            return list(pool.map(one, range(len(self.urls))))

    def _begin(self, body: dict) -> None:
        """Rank 0: every engine accepted ``body`` (or SyncError naming the first refusal)."""
        if self.config.control == "http":
            self._call_all("POST", "/weights/begin", [body] * len(self.urls))
            return
        assert self._store is not None and self.group is not None
        self._ctl += 1
        name = self.group.rdv.name
        self._store.set(ctl_key(name, self._ctl, "begin"), json.dumps(body))
        for i, url in enumerate(self.urls):
            answer = self._ctl_wait(ctl_key(name, self._ctl, "accepted", i))
            if "error" in answer:
                raise SyncError(f"{url} refused update {body['version']}: {answer['error']}")

    def _finish(self, version: int) -> list[dict]:
        """Rank 0: every engine's ``UpdateResult`` of the update just moved."""
        if self.config.control == "http":
            return self._call_all("POST", "/weights/finish", [{"version": version}] * len(self.urls))
        assert self.group is not None
        results = [self._ctl_wait(ctl_key(self.group.rdv.name, self._ctl, "result", i))
                   for i in range(len(self.urls))]
        bad = next(((u, r) for u, r in zip(self.urls, results, strict=True) if not r["ok"]), None)
        if bad is not None:
            raise SyncError(f"{bad[0]}: update {version} failed: {bad[1]['error']}; the engine refuses "
                            "generation until a full update")
        return results

    def _ctl_wait(self, key: str) -> dict:
        assert self._store is not None
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.config.http_timeout_s))
        except dist.DistStoreError:
            raise SyncError(f"no answer under {key} within {self.config.http_timeout_s}s "
                            "(engine gone or stuck)") from None
        return json.loads(self._store.get(key))

    def _share(self, obj):
        """Rank 0's ``obj`` on every trainer rank (connect only; the trainer's own group)."""
        if self.parallel.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, group=self.trainer_group, group_src=0)
        return box[0]

    def _signal(self, key: str, value: object | None = None):
        """Rank 0 publishes ``value`` under ``key``; other ranks wait for it (bounded)."""
        assert self._store is not None
        if self.rank == 0:
            self._store.set(key, pickle.dumps(value))
            return value
        self._store.wait([key], self.group.rdv.timeout)
        return pickle.loads(self._store.get(key))

    # -- public API --

    def connect(self) -> None:
        """Collective over trainer ranks: agree on engines and mode, then join the sync group."""
        t0 = time.perf_counter()
        decision = None
        if self.rank == 0:
            try:
                infos = self._call_all("GET", "/weights/info")
                tps = [i["tp"] for i in infos]
                dtypes = {i["dtype"] for i in infos}
                if len(dtypes) != 1:
                    raise SyncError(f"engines run different dtypes {sorted(dtypes)}")
                port = self.config.port or free_port(self.config.host)
                decision = {"tps": tps, "dtype": dtypes.pop(), "port": port,
                            "name": f"shardsync-{uuid.uuid4().hex[:8]}"}
            except Exception as e:
                decision = {"error": f"{type(e).__name__}: {e}"}
        decision = self._share(decision)
        if "error" in decision:
            raise SyncError(f"connect failed on trainer rank 0: {decision['error']}")
        dtype = decision["dtype"]
        topo = Topology(self.spec.replace(dtype=dtype), self.parallel,
                        tuple(EngineParallel(tp=t, dtype=dtype) for t in decision["tps"]),
                        engine_kind=self.config.engine_kind, engine_pp=self.config.engine_pp,
                        quantization=self.config.quantization, relay=self.config.relay)
        self.mode, self.fallback_reason = self._choose_mode(topo)
        # Both paths are planned when p2p is possible, so each update may pick either.
        self.modes = ("p2p", "broadcast") if self.mode == "p2p" else ("broadcast",)
        fingerprints = {"broadcast": topo.fingerprint("broadcast")}
        if self.mode == "p2p":
            fingerprints["p2p"] = topo.fingerprint("p2p")
        device = next(iter(self.params.values())).device  # buffers live where the weights do
        sched = Schedule(topo, self.rank, int(self.config.bucket_mb * 2**20), credits=self.config.credits,
                         device=device)
        for stage in range(topo.trainer.pp):
            sched.steps("broadcast", stage)
        if self.mode == "p2p":
            sched.steps("p2p")
        world = topo.trainer.world_size + topo.num_engine_ranks
        rdv = Rendezvous(self.config.host, decision["port"], world, decision["name"],
                         self.config.backend, self.config.timeout_s)
        ok = None
        if self.rank == 0:
            try:
                payloads = [self._connect_payload(topo, i, fingerprints, rdv) for i in range(len(self.urls))]
                self._call_all("POST", "/weights/connect", payloads)
                ok = {"ok": True}
            except Exception as e:
                ok = {"error": str(e)}
        ok = self._share(ok)
        if "error" in ok:
            raise SyncError(f"engines refused the connect: {ok['error']}")
        self.plan_s = time.perf_counter() - t0
        self.topo, self._sched = topo, sched

        def join() -> None:
            self.group = SyncGroup(rdv, self.rank, sched.subgroups(), store=self._store)
            # IPC slots are published before anyone waits for the engines' join to return:
            # the engines map them as the last step of their join.
            self._transport = self._export_ipc(topo, sched, rdv) if self.config.ipc else self.group

        self._ctl = 0  # the engines count store-controlled updates from 1 per connection
        if self.rank == 0:
            self._store = open_store(rdv, is_master=True)
            with ThreadPoolExecutor(1) as pool:
                joined = pool.submit(self._call_all, "POST", "/weights/join")
                join()
                joined.result()
        else:
            self._store = open_store(rdv, is_master=False)
            join()
        if self.config.mode == "delta":
            if self._snapshot is None:
                self._snapshot = Snapshot(self.params, getattr(torch, topo.wire_dtype),
                                          pin=self.config.delta_pin_memory)
            self._delta = DeltaRunner(topo, self.rank, sched.bucket_bytes, credits=self.config.credits,
                                      snapshot=self._snapshot)
            if self.config.delta_transport == "disk":
                Path(self.config.delta_dir).mkdir(parents=True, exist_ok=True)
                self._disk = DiskPublisher(topo, self.rank, str(self.config.delta_dir), self._snapshot,
                                           budget=sched.bucket_bytes, credits=self.config.credits)
            self._synced = None  # a (re)connected engine set starts with a full update
        if self.rank == 0:
            if self.fallback_reason:
                log.info("[rank 0] mode=auto falls back to broadcast: %s", self.fallback_reason)
            log.info("[rank 0] connected %d engine(s) TP %s, mode=%s, plan+connect %.3fs",
                     len(self.urls), decision["tps"], self.mode, time.perf_counter() - t0)

    def _export_ipc(self, topo: Topology, sched: Schedule, rdv: Rendezvous) -> IpcTransport | MappedTransport:
        """Publish this rank's tensors ("map") or IPC slots ("slots") to the engine ranks it feeds."""
        if self.mode != "p2p":
            raise SyncError(f"ipc needs the p2p path, but {self.fallback_reason}")
        if self.config.ipc == "map":
            mapped = MappedTransport.for_rank(self.group, topo, rdv.name)
            mapped.export(self.params)
            return mapped
        transport = IpcTransport(self.group, slots=self.config.credits)
        device = next(iter(self.params.values())).device
        for peer in sorted({s.comm[1] for s in sched.steps("p2p") if s.comm[0] == "send"}):
            numel = max(s.numel for s in sched.steps("p2p") if s.comm == ("send", peer))
            transport.export(peer, numel, getattr(torch, topo.wire_dtype), device)
        return transport

    def add_engine(self, url: str) -> None:
        """Collective over trainer ranks: bring a new engine in while training runs.

        Reconnects every engine in one new sync group (plans are rebuilt for the new
        engine list); the next ``update`` is a full update for all, after which the new
        engine serves the current version like the others.
        """
        self._drop_group()
        self.urls.append(url.rstrip("/"))
        self.connect()

    def _choose_mode(self, topo: Topology) -> tuple[str, str | None]:
        """The full-update path: p2p when its preconditions hold (auto, delta), else broadcast."""
        if self.config.mode == "broadcast":
            return "broadcast", None
        verdicts = check_p2p(topo)
        failed = next((v for v in verdicts if not v.ok), None)
        if failed is None:
            return "p2p", None
        reason = f"p2p precondition {failed.name} failed: {failed.detail}"
        if self.config.mode == "p2p":
            raise ValueError(f"mode='p2p' requested but {reason}; use mode='auto' or 'broadcast'")
        return "broadcast", reason

    # -- delta --

    def _delta_transport(self) -> str:
        t = self.config.delta_transport
        return "broadcast" if t == "p2p" and "p2p" not in self.modes else t

    def _delta_plan(self) -> str | None:
        """Rank 0's choice for this update: a delta transport, or None for a full update."""
        if self._snapshot is None or not self._snapshot.valid or self._synced is None:
            return None  # the first sync is always full
        versions = self._call_all("GET", "/weights/version")
        if any(v["stale"] or v["weight_version"] != self._synced for v in versions):
            log.info("[rank 0] delta skipped: engines at versions %s, trainer synced %s; full update",
                     [v["weight_version"] for v in versions], self._synced)
            return None
        return self._delta_transport()

    def _connect_payload(self, topo: Topology, index: int, fingerprints: dict, rdv: Rendezvous) -> dict:
        t = self.parallel
        return {
            "spec": asdict(topo.spec),
            "trainer": {"tp": t.tp, "pp": t.pp, "dp": t.dp,
                        "pp_layers": list(t.pp_layers) if t.pp_layers else None,
                        "make_vocab_size_divisible_by": t.make_vocab_size_divisible_by,
                        "norm_names": t.norm_names, "dtype": t.dtype},
            "engines": [e.tp for e in topo.engines], "engine_index": index,
            "fingerprints": fingerprints, "bucket_bytes": int(self.config.bucket_mb * 2**20),
            "credits": self.config.credits, "relay": self.config.relay, "ipc": self.config.ipc,
            "control": self.config.control,
            "rendezvous": asdict(rdv),
        }

    def update(self, version: int, *, mode: str | None = None) -> UpdateRecord:
        """Collective over trainer ranks: push the current parameters as ``version``.

        ``mode`` overrides the connected mode for this update (``"broadcast"`` always works;
        ``"p2p"`` when its preconditions held at connect).  With ``mode="delta"`` configured,
        an update sends only changed elements when every engine holds the version this
        trainer synced last, and a full update otherwise (first sync, a restarted or stale
        engine, a missed step).  Re-sending the engine's current version is allowed.
        """
        if self.group is None or self.topo is None or self._sched is None:
            raise SyncError("not connected; call connect() first")
        if mode is not None and mode not in self.modes:
            raise ValueError(f"mode {mode!r} not available for this connection (have {self.modes}"
                             f"{'; ' + self.fallback_reason if self.fallback_reason else ''})")
        t0 = time.perf_counter()
        go = None
        if self.rank == 0:
            try:
                delta = self._delta_plan() if self.config.mode == "delta" and mode is None else None
                wire = f"delta-{delta}" if delta else (mode or self.mode)
                body = {"version": version, "mode": wire,
                        "fingerprint": self.topo.fingerprint(wire.removeprefix("delta-").replace("disk", "broadcast"))}
                if delta:
                    body["base_version"] = self._synced
                if delta != "disk":  # files need no receive loop: engines pull after publishing
                    self._begin(body)
                go = {"mode": wire}
            except Exception as e:
                go = {"error": str(e)}
        self._updates += 1  # store keys are per call: a version may be sent twice (resync)
        key = f"u{self._updates}"
        go = self._signal(f"{key}/begin", go)
        if "error" in go:
            raise SyncError(f"update {version} refused: {go['error']}")
        mode = go["mode"]
        if mode == "delta-disk":
            return self._update_disk(version, t0, key)
        t1 = time.perf_counter()
        error, stats, dstats = None, None, None
        try:
            if mode.startswith("delta-"):
                assert self._delta is not None
                dstats = self._delta.run(mode.removeprefix("delta-"), self.params, self.group)
            else:
                stats = self._sched.run(mode, self.params, self._transport if mode == "p2p" else self.group,
                                        barrier=self.group.barrier, detail=self.config.detail)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        t2 = time.perf_counter()
        done = None
        if self.rank == 0:
            try:
                done = {"engines": self._finish(version)}
            except Exception as e:
                done = {"error": str(e), "engines": []}
        done = self._signal(f"{key}/done", done)
        t3 = time.perf_counter()
        error = error or done.get("error")
        record = self._record(version, mode, error, stats, dstats, done.get("engines", []),
                              {"control": (t1 - t0) + (t3 - t2), "total": t3 - t0})
        if self.rank == 0:
            (log.info if record.ok else log.error)("[rank 0] %s", record.summary())
            if self.config.records_path:
                append_jsonl(self.config.records_path, record)
        if error is not None:
            self._synced = None
            self._drop_group()
            raise SyncError(f"update {version} failed: {error}")
        if self._snapshot is not None:
            self._snapshot.refresh()
            self._synced = version
        return record

    def _update_disk(self, version: int, t0: float, key: str) -> UpdateRecord:
        """Delta through files: every trainer rank writes its share, rank 0 publishes and asks
        each engine to pull (one HTTP call per engine), then all ranks learn the outcome."""
        assert self._disk is not None and self._synced is not None
        t1 = time.perf_counter()
        error, dstats = None, None
        try:
            dstats = self._disk.write(version, self._synced, self.group)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        written = self._store_all(f"{key}/written", error)
        done = None
        if self.rank == 0:
            try:
                if any(written):
                    raise SyncError(f"writing version {version} failed: {next(w for w in written if w)}")
                self._disk.publish(version, self._synced)
                root = str(self.config.delta_dir)
                done = {"engines": self._call_all("POST", "/weights/pull",
                                                  [{"root": root, "version": version}] * len(self.urls))}
            except Exception as e:
                done = {"error": str(e), "engines": []}
        t2 = time.perf_counter()
        done = self._signal(f"{key}/done", done)
        error = error or done.get("error")
        record = self._record(version, "delta-disk", error, None, dstats, done.get("engines", []),
                              {"control": time.perf_counter() - t2 + (t1 - t0),
                               "total": time.perf_counter() - t0})
        if self.rank == 0:
            (log.info if record.ok else log.error)("[rank 0] %s", record.summary())
            if self.config.records_path:
                append_jsonl(self.config.records_path, record)
        if error is not None:
            self._synced = None  # the next update is a full one
            raise SyncError(f"update {version} failed: {error}")
        assert self._snapshot is not None
        self._snapshot.refresh()
        self._synced = version
        return record

    def _store_all(self, key: str, value: object) -> list:
        """Every trainer rank's ``value`` (via the store), on every rank."""
        assert self._store is not None and self.group is not None
        self._store.set(f"{key}/{self.rank}", pickle.dumps(value))
        keys = [f"{key}/{r}" for r in range(self.parallel.world_size)]
        self._store.wait(keys, self.group.rdv.timeout)
        return [pickle.loads(self._store.get(k)) for k in keys]

    def _record(self, version: int, mode: str, error: str | None, stats, dstats, engines: list,
                times: dict[str, float]) -> UpdateRecord:
        assert self.topo is not None and self._sched is not None
        unpack = max((e.get("unpack_s", 0.0) for e in engines), default=0.0)
        if dstats is not None:
            phases = {"plan": self.plan_s, "pack": dstats.encode_s, "transfer": dstats.transfer_s,
                      "unpack": unpack, **times}
            delta = {"elements": dstats.elements, "bytes_sent": dstats.bytes_sent,
                     "encodings": dict(dstats.encodings),
                     "engine_changed": sum(e.get("changed", 0) for e in engines),
                     "engine_bytes_received": sum(e.get("bytes_received", 0) for e in engines)}
            return UpdateRecord(version=version, mode=mode, ok=error is None, fallback_reason=None,
                                rank=self.rank, bytes_sent=dstats.bytes_sent, buckets=0, phases=phases,
                                engines=engines, error=error, delta=delta,
                                link_bytes={f"rank{self.rank}->engines": dstats.bytes_sent})
        plan = self.topo.p2p_plan if mode == "p2p" else self.topo.broadcast_plan
        buckets = sum(len(self._sched.steps(mode, s)) for s in
                      range(self.topo.trainer.pp if mode == "broadcast" else 1))
        return UpdateRecord(
            version=version, mode=mode, ok=error is None,
            fallback_reason=self.fallback_reason if mode == "broadcast" else None,
            rank=self.rank, bytes_sent=stats.bytes_sent if stats else 0,
            buffer_bytes=stats.peak_buffer_bytes if stats else 0, buckets=buckets,
            phases={"plan": self.plan_s, "pack": stats.pack_s if stats else 0.0,
                    "transfer": stats.transfer_s if stats else 0.0, "unpack": unpack, **times},
            link_bytes={f"{plan.src.ranks[s].label}->{plan.dst.ranks[d].label}": b
                        for (s, d), b in plan.link_bytes.items()} if self.rank == 0 else {},
            engines=engines,
            steps=[asdict(s) for s in stats.steps] if stats and self.config.detail else [],
            error=error,
        )

    def verify(self) -> list[str]:
        """Collective over trainer ranks: logical tensors whose engine checksum differs (bitwise).

        Compares each engine's loaded weights with this trainer's parameters converted to the
        engine dtype; an empty list means every engine holds exactly the trainer's weights.
        """
        if self.group is None or self.topo is None:
            raise SyncError("not connected; call connect() first")
        lay = self.topo.trainer_layout
        dtype = getattr(torch, self.topo.wire_dtype)
        mine = piece_checksums(lay.ranks[self.rank], self.params, lay.logical, dtype)
        key = f"ck/{uuid.uuid4().hex}" if self.rank == 0 else None
        key = self._signal(f"ck/{self._next_check()}", key)
        self._store.set(f"{key}/{self.rank}", pickle.dumps(mine))
        bad = None
        if self.rank == 0:
            parts = []
            for r in range(self.parallel.world_size):
                self._store.wait([f"{key}/{r}"], self.group.rdv.timeout)
                parts.append(pickle.loads(self._store.get(f"{key}/{r}")))
            expected = combine(parts)
            bad = []
            for url, res in zip(self.urls, self._call_all("GET", "/weights/checksum"), strict=True):
                got = {k: (None if v is None else int(v)) for k, v in res["checksums"].items()}
                bad += [f"{url}: {n}" for n in compare(expected, got)]
        return self._signal(f"{key}/result", bad)

    _checks = 0

    def _next_check(self) -> int:
        self._checks += 1
        return self._checks

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None

    def close(self) -> None:
        """Collective over trainer ranks: engines leave the sync group (and unmap this
        trainer's memory) before any trainer rank lets go of its tensors."""
        if self.group is not None and self._store is not None:
            if self.rank == 0:
                try:
                    self._call_all("POST", "/weights/disconnect")
                except Exception as e:  # an engine that is gone needs no goodbye
                    log.debug("disconnect: %s", e)
            try:
                self._signal(f"u{self._updates}/closed", True)
            except Exception as e:
                log.debug("close signal: %s", e)
        self._drop_group()
        if self._http is not None:
            self._http.close()


def records_to_json(records: Sequence[UpdateRecord]) -> str:
    return json.dumps([asdict(r) for r in records])
