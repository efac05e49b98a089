"""Soak and fault run on loopback: updates of every path while clients keep scoring, with
faults injected between and inside updates; prints one table and writes JSON.

    python benchmarks/soak.py --quick          # each fault once (a few minutes on 2 cores)
    python benchmarks/soak.py --rounds 3       # each fault three times, more updates between

One reference engine (TP 2, a token, a delta root) and a trainer world (TP 2, fp32, digests
on every bucket, delta over p2p) in their own processes; K client threads post a fixed probe
to ``/logprobs`` throughout.  Faults: SIGKILL of a trainer rank mid-update, of an engine TP
worker, of the engine launcher; a sender stalled past the timeout; a corrupted bucket on the
wire (the fault injector below, a stand-in for a bad link); a delta against the wrong base;
the whole engine SIGKILLed under the trainer's first bucket; another local process that floods
the trainer's rendezvous store with junk (thousands of keys, unsigned values under the
sync's answer keys).
For each: detected, seconds to detect, engine state after, recovered (reconnect + a full
update that verifies bitwise).  Totals: hangs beyond timeout, responses from mixed weights
(two different answers for one weight version, or an answer for a version that never
committed), silent corruptions (an update reported ok that does not verify), leaked
processes, /dev/shm names and listening ports (every one the run made, whatever its name).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import httpx
import torch
import torch.multiprocessing as mp

from shardsync.launch.procs import alive, children, listening_ports

TIMEOUT_S = 10.0  # sync group timeout: every detection must come within this (plus slack)
SLACK_S = 30.0
PROBE = [[1, 5, 9, 13, 17, 21, 25, 29]]
MODEL = "tiny-qwen3"


def _shm() -> set[str]:
    """Every name in /dev/shm (torch's tensors, multiprocessing's semaphores, engines' own)."""
    return {p.name for p in Path("/dev/shm").iterdir()}


# -- the engine --

class Engine:
    def __init__(self, token_file: str, root: str) -> None:
        self.token_file, self.root = token_file, root
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.pids: set[int] = set()
        self.ports: set[int] = set()

    def start(self) -> None:
        from shardsync.control.client import wait_healthy
        from shardsync.engine.launch import EngineConfig, spawn_server

        cfg = EngineConfig(model=MODEL, tp=2, port=0, token_file=self.token_file, delta_root=self.root)
        self.proc, self.url = spawn_server(cfg, stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"))
        wait_healthy(self.url, self.proc, 120)
        self.pids |= {self.proc.pid, *self.workers()}
        self.ports.add(cfg.port)

    def workers(self) -> list[int]:
        return children(self.proc.pid) if self.proc is not None else []

    def health(self) -> dict | None:
        try:
            return httpx.get(self.url + "/health", timeout=2).json()
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait(5)


# -- the clients --

class Clients:
    """Threads posting the probe; every 200 answer is kept as (version, hash of the logprobs)."""

    def __init__(self, engine: Engine, k: int) -> None:
        self.engine, self.k = engine, k
        self.answers: list[tuple[int, str]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(k)]

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                try:
                    r = c.post(self.engine.url + "/logprobs", json={"sequences": PROBE})
                except httpx.HTTPError:
                    self.errors += 1
                    time.sleep(0.2)
                    continue
                if r.status_code == 200:
                    body = r.json()
                    digest = hashlib.sha256(json.dumps(body["logprobs"]).encode()).hexdigest()[:16]
                    self.answers.append((body["weight_version"], digest))
                else:
                    time.sleep(0.05)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)


# -- the trainer world --

class DieOnSend:
    """Fault injector: this trainer rank SIGKILLs itself on its first data send of the update,
    i.e. after the engines began receiving it (a rank lost mid-update)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def send(self, buf, peer):
        if buf.dtype != torch.int64:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.send(buf, peer)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class KillsEngineOnSend:
    """Fault injector: on this trainer rank's first data send the whole engine (launcher and
    TP workers) is SIGKILLed, an engine lost mid-update; the moment is kept."""

    def __init__(self, inner, pids: list[int], killed: list[float]) -> None:
        self.inner, self.pids, self.killed = inner, pids, killed

    def send(self, buf, peer):
        if not self.killed and buf.dtype != torch.int64:
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.killed.append(time.monotonic())
        return self.inner.send(buf, peer)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Rogue:
    """Another local process's client of the trainer's rendezvous store (it knows the sync's
    name, the worst case): thousands of junk keys, and unsigned junk under every answer key an
    engine would write, rewritten until stopped."""

    def __init__(self, where: dict, junk_keys: int = 5000) -> None:
        import datetime

        import torch.distributed as dist

        from shardsync.store.keys import Keys

        self.store = dist.TCPStore(where["host"], where["port"], None, False,
                                   timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
        self.keys, self.junk_keys = Keys(where["name"]), junk_keys
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        junk = os.urandom(512).hex()  # 1 KiB
        for i in range(self.junk_keys):
            self.store.set(f"junk/{i}", junk)
        while not self._stop.is_set():
            for seq in range(1, 64):
                for key in (self.keys.accepted(seq, 0), self.keys.result(seq, 0)):
                    self.store.set(key, '{"ok": true}')
            time.sleep(0.01)

    def __enter__(self) -> Rogue:
        self._thread.start()
        time.sleep(0.5)  # the flood is in before the update starts
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)


class FaultyLink:
    """Fault injector (a stand-in for a bad link): sends a copy of the first data message with
    one byte flipped; the executor's digest is of the true bytes, as a sender's would be."""

    def __init__(self, inner) -> None:
        self.inner, self.done = inner, False

    def send(self, buf, peer):
        if not self.done and buf.dtype != torch.int64:
            self.done = True
            bad = buf.clone()
            bad.view(torch.uint8)[7] ^= 0x40
            return self.inner.send(bad, peer)
        return self.inner.send(buf, peer)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _trainer(rank: int, world: int, port: int, url: str, token: str, ipc: bool, commands, results) -> None:
    import datetime

    import torch.distributed as dist

    from shardsync.config import (
        ColocatedConfig,
        ControlConfig,
        DeltaConfig,
        SyncConfig,
        TransportConfig,
    )
    from shardsync.layout import MegatronParallel
    from shardsync.mode import Mode
    from shardsync.models.weights import load_rank, random_source
    from shardsync.presets import load_spec
    from shardsync.sync import WeightSync
    from shardsync.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    spec, par = load_spec(MODEL), MegatronParallel(tp=world, dtype="float32")
    params = load_rank(Topology(spec, par).trainer_layout, rank, random_source(spec, seed=0))
    cfg = SyncConfig(delta=None if ipc else DeltaConfig(transport="p2p"),
                     colocated=ColocatedConfig(ipc="map") if ipc else None,
                     control=ControlConfig(token=token, http_timeout_s=2 * TIMEOUT_S),
                     transport=TransportConfig(timeout_s=TIMEOUT_S, bucket_mb=1, verify_buckets=True))
    sync = WeightSync(spec, par, rank, params, [url], cfg, trainer_group=dist.group.WORLD)
    killed: list[float] = []
    while True:
        cmd = commands.get()
        if cmd["op"] == "stop":
            break
        t0 = time.perf_counter()
        out = {"op": cmd["op"], "rank": rank}
        try:
            if cmd["op"] == "connect":
                sync.connect()
                assert sync.group is not None  # connected
                rdv = sync.group.rdv
                out["store"] = {"host": rdv.host, "port": rdv.port, "name": rdv.name}
            elif cmd["op"] == "update":
                for name, p in params.items():  # a sparse step; replicas (norms) change alike on every rank
                    g = torch.Generator().manual_seed(zlib.crc32(f"{name}{tuple(p.shape)}{cmd['version']}".encode()))
                    p.view(-1)[torch.randint(0, p.numel(), (max(1, p.numel() // 200),), generator=g)] += 1e-3
                fault = cmd.get("fault")
                restore = None
                if fault == "stall" and rank == world - 1:
                    time.sleep(TIMEOUT_S + 3)
                injector = {("corrupt", 0): FaultyLink, ("die", world - 1): DieOnSend}.get((fault, rank))
                program = sync.programs[Mode.P2P]
                if injector is not None:
                    restore, program.transport = program.transport, injector(program.transport)
                elif fault == "kill-engine" and rank == 0:
                    killed.clear()
                    restore = program.transport
                    program.transport = KillsEngineOnSend(program.transport, cmd["pids"], killed)
                try:
                    rec = sync.update(cmd["version"], mode=cmd.get("mode"))
                finally:
                    if restore is not None:
                        sync.programs.get(Mode.P2P, program).transport = restore
                out["mode"] = rec.mode
                out["verify"] = sync.verify()
            out["ok"] = True
        except Exception as e:
            out["ok"], out["error"] = False, f"{type(e).__name__}: {e}"[:2000]
            if killed:
                out["after_kill_s"] = time.monotonic() - killed[0]
        out["s"] = time.perf_counter() - t0
        results.put(out)
    try:
        sync.close()
    except Exception:
        pass
    dist.destroy_process_group()


class Trainers:
    def __init__(self, url: str, token: str, world: int = 2, ipc: bool = False) -> None:
        from shardsync.store.rendezvous import free_port

        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_trainer,
                                  args=(r, world, port, url, token, ipc, self.commands[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.store: dict = {}  # where rank 0 hosts the sync's store (its connect answer)

    def call(self, op: str, timeout_s: float, **kw) -> tuple[dict | None, float]:
        """Rank 0's answer (None: none within ``timeout_s``, a hang) and seconds taken."""
        t0 = time.monotonic()
        for r, q in enumerate(self.commands):
            if self.procs[r].is_alive():
                q.put({"op": op, **kw})
        want = sum(p.is_alive() for p in self.procs)
        got: dict[int, dict] = {}
        while len(got) < want and time.monotonic() - t0 < timeout_s:
            try:
                res = self.results.get(timeout=0.5)
            except Exception:
                want = min(want, sum(p.is_alive() for p in self.procs) + len(got))
                continue
            got[res["rank"]] = res
            if res["rank"] == 0 and op == "update":
                break  # other ranks may be waiting on a killed peer's timeout
        return got.get(0), time.monotonic() - t0

    def stop(self) -> None:
        for r, q in enumerate(self.commands):
            if self.procs[r].is_alive():
                q.put({"op": "stop"})
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in (*self.commands, self.results):  # the driver's own semaphores go with its queues
            q.close()
            q.join_thread()
        self.commands = []
        del self.results  # drop the closed queue (a later use fails as it did with None)


# -- the run --

class Soak:
    def __init__(self, args) -> None:
        self.args = args
        self.dir = Path(args.workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        (self.dir / "token").write_text(self.token)
        (self.dir / "versions").mkdir(exist_ok=True)
        self.engine = Engine(str(self.dir / "token"), str(self.dir / "versions"))
        self.version = 0
        self.committed: set[int] = {0}
        self.rows: list[dict] = []
        self.hangs = self.silent = 0
        self.updates: dict[str, int] = {}
        self.trainer_pids: set[int] = set()

    def trainers(self, ipc: bool = False) -> Trainers:
        t = Trainers(self.engine.url, self.token, ipc=ipc)
        self.trainer_pids |= {p.pid for p in t.procs if p.pid is not None}  # started: every pid is set
        res, s = t.call("connect", 120)
        if res is None or not res["ok"]:
            raise RuntimeError(f"trainer connect failed: {res}")
        t.store = res["store"]
        return t

    def update(self, t: Trainers, mode: str | None = None, fault: str | None = None,
               label: str | None = None, **extra) -> dict | None:
        self.version += 1
        res, s = t.call("update", TIMEOUT_S * 3 + SLACK_S, version=self.version, mode=mode, fault=fault, **extra)
        if res is None:
            self.hangs += 1
            return None
        if res["ok"]:
            self.committed.add(self.version)
            key = res["mode"] + (f" ({label})" if label else "")
            self.updates[key] = self.updates.get(key, 0) + 1
            if res["verify"]:
                self.silent += 1
        return res

    def normal(self, t: Trainers, n: int) -> None:
        for i in range(n):
            self.update(t, mode=(None, "p2p", "broadcast")[i % 3])

    def recover(self, t: Trainers | None, restart_engine: bool, ipc: bool = False) -> tuple[Trainers, bool]:
        if t is not None:
            t.stop()
        if restart_engine:
            self.engine.stop()
            self.engine.start()
            self.clients.engine = self.engine
        t = self.trainers(ipc=ipc)
        res = self.update(t, mode="p2p", label="ipc map" if ipc else None)
        ok = bool(res and res["ok"] and res["verify"] == [])
        return t, ok

    def fault(self, t: Trainers, name: str) -> Trainers:
        t0 = time.monotonic()
        detected, restart, res = False, False, None
        measured: float | None = None
        if name == "trainer rank killed mid-update":
            res = self.update(t, fault="die", mode="p2p")
            detected = res is not None and not res["ok"]
        elif name == "engine TP worker killed":
            workers = self.engine.workers()
            assert self.engine.proc is not None  # started in run() before any fault
            os.kill(workers[-1], signal.SIGKILL)
            deadline = time.monotonic() + TIMEOUT_S + SLACK_S
            while self.engine.proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            detected = self.engine.proc.poll() is not None
            restart = True
        elif name == "engine launcher killed":
            workers = self.engine.workers()
            assert self.engine.proc is not None  # started in run() before any fault
            self.engine.proc.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + TIMEOUT_S + SLACK_S
            while any(alive(w) for w in workers) and time.monotonic() < deadline:
                time.sleep(0.1)
            detected = not any(alive(w) for w in workers)
            restart = True
        elif name == "engine killed mid-update":
            assert self.engine.proc is not None  # started in run() before any fault
            pids = [self.engine.proc.pid, *self.engine.workers()]
            res = self.update(t, fault="kill-engine", mode="p2p", pids=pids)
            detected = res is not None and not res["ok"] and self.engine.url in res["error"]
            if res is not None and "after_kill_s" in res:
                measured = res["after_kill_s"]  # from the kill to the trainer's error, in the trainer
            restart = True
        elif name == "store flooded by another local process":
            with Rogue(t.store):
                t0 = time.monotonic()
                res = self.update(t, mode="p2p")
            detected = res is not None and not res["ok"] and "not signed" in res["error"]
        elif name == "sender stalled past the timeout":
            res = self.update(t, fault="stall", mode="p2p")
            detected = res is not None and not res["ok"]
        elif name == "corrupted bucket on the wire":
            res = self.update(t, fault="corrupt", mode="p2p")
            detected = res is not None and not res["ok"] and "corrupted" in res.get("error", "")
        elif name == "colocated trainer rank killed":  # its exported tensors are still mapped
            pid = t.procs[-1].pid
            assert pid is not None  # the trainer processes are started
            os.kill(pid, signal.SIGKILL)
            res = self.update(t, mode="p2p")
            detected = res is not None and not res["ok"]
        elif name == "delta against the wrong base":
            before = self.engine.health()
            r = httpx.post(self.engine.url + "/weights/begin", timeout=10,
                           headers={"Authorization": f"Bearer {self.token}"},
                           json={"version": self.version + 5, "mode": "delta-p2p", "fingerprint": "x",
                                 "base_version": max(0, self.version - 1)})
            after = self.engine.health()
            detected = r.status_code == 409 and before == after
        detect_s = measured if measured is not None else time.monotonic() - t0
        health = self.engine.health()
        if health is not None and not health["stale"]:  # the engine took it whole (the trainer may not know)
            self.committed.add(health["weight_version"])
        state = "down" if health is None else ("stale" if health["stale"] else "serving")
        if name == "delta against the wrong base":
            recovered = state == "serving"
        else:
            t, recovered = self.recover(t, restart, ipc=name.startswith("colocated"))
        self.rows.append({"fault": name, "detected": detected, "detect_s": round(detect_s, 2), "state_after": state,
                          "recovered": recovered, "error": (res or {}).get("error", "")[:400] if res else ""})
        print(f"  {name:<34} detected={'yes' if detected else 'NO'} in {detect_s:5.1f}s, engine {state}, "
              f"recovered={'yes' if recovered else 'NO'}", flush=True)
        return t

    def run(self) -> dict:
        shm0, ports0 = _shm(), listening_ports()
        t0 = time.monotonic()
        self.engine.start()
        self.clients = Clients(self.engine, self.args.clients)
        self.clients.start()
        t = self.trainers()
        faults = ["delta against the wrong base", "corrupted bucket on the wire", "sender stalled past the timeout",
                  "trainer rank killed mid-update", "engine TP worker killed", "engine launcher killed",
                  "engine killed mid-update", "store flooded by another local process"]
        try:
            self.normal(t, self.args.between)
            for _ in range(self.args.rounds):
                for f in faults:
                    t = self.fault(t, f)
                    self.normal(t, self.args.between)
            t.stop()  # colocated: engines read the trainer's tensors in place (shared memory here)
            t = self.trainers(ipc=True)
            for _ in range(self.args.ipc_updates):
                self.update(t, label="ipc map")
            t = self.fault(t, "colocated trainer rank killed")
            for _ in range(self.args.ipc_updates):
                self.update(t, label="ipc map")
        finally:
            self.clients.stop()
            t.stop()
            self.engine.stop()
        del t
        gc.collect()
        deadline = time.monotonic() + 10  # resource trackers unlink a dead process's names shortly after
        pids = self.engine.pids | self.trainer_pids
        while time.monotonic() < deadline and (_shm() - shm0 or listening_ports() - ports0
                                               or any(alive(p) for p in pids)):
            time.sleep(0.5)
        by_version: dict[int, dict[str, int]] = {}
        for v, h in self.clients.answers:
            by_version.setdefault(v, {}).setdefault(h, 0)
            by_version[v][h] += 1
        mixed = sum(sum(c.values()) - max(c.values()) for c in by_version.values())
        mixed += sum(sum(c.values()) for v, c in by_version.items() if v not in self.committed)
        leaked = [p for p in self.engine.pids | self.trainer_pids if alive(p)]
        shm_left = sorted(_shm() - shm0)
        ports_left = sorted(listening_ports() - ports0)
        return {"seconds": time.monotonic() - t0, "faults": self.rows, "updates": self.updates,
                "client_answers": len(self.clients.answers), "versions_answered": len(by_version),
                "totals": {"hangs beyond timeout": self.hangs, "responses served from mixed weights": mixed,
                           "silent corruptions": self.silent,
                           "leaked processes/shm": len(leaked) + len(shm_left) + len(ports_left)},
                "leaked": {"pids": leaked, "shm": shm_left, "listening_ports": ports_left},
                "answers_by_version": {str(v): c for v, c in sorted(by_version.items())},
                "committed": sorted(self.committed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="each fault once, two updates between")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--between", type=int, default=3, help="normal updates between faults")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--ipc-updates", type=int, default=3, help="colocated (ipc map) updates at the end")
    ap.add_argument("--workdir", default="out/soak")
    ap.add_argument("--out", default="soak.json")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.between = 1, 3
    print(f"soak: {MODEL} trainer TP2 -> engine TP2 (token, digests on, delta over p2p), {args.clients} clients, "
          f"{args.rounds} round(s) of 8 faults, {args.between} updates between, then colocated (ipc map) "
          f"updates around a killed colocated trainer rank", flush=True)
    res = Soak(args).run()
    print("\n| fault | detected | seconds to detect | engine after | recovered |\n|---|---|---|---|---|")
    for r in res["faults"]:
        print(f"| {r['fault']} | {'yes' if r['detected'] else 'no'} | {r['detect_s']:.1f} | {r['state_after']} | "
              f"{'yes' if r['recovered'] else 'no'} |")
    print(f"\nupdates that committed, by path: {res['updates']}; client answers: {res['client_answers']} over "
          f"{res['versions_answered']} versions; {res['seconds']:.0f}s")
    for k, v in res["totals"].items():
        print(f"{k}: {v}")
    with open(args.out, "w") as f:
        json.dump({"command": "python benchmarks/soak.py " + " ".join(sys.argv[1:]),
                   "machine": f"{platform.node()} {platform.platform()} {os.cpu_count()} cpus", **res}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
