"""One-sided transport for engines on the trainer's machine: the engine reads the trainer's
tensors in place, through CUDA IPC (same GPU or peer GPUs of one node) or CPU shared memory.

The trainer exports its tensors once (handles through the rendezvous store); each engine
rank maps them once and compiles its share of the p2p plan into (destination view, mapped
source view) copies, strided where a per-group pattern allows.  An update moves every byte
once: the trainer marks the end of its writes and signals ``[generation, stream]``; the
engine copies after those writes and acks; the trainer returns only after every ack, so its
tensors are never written while an engine reads them.  Between GPUs both marks are CUDA IPC
events (``transport.events``): the engine's copies wait on the trainer's event, and with
``stream`` (``ColocatedConfig(complete="stream")``) the engine acks as soon as its copies are
queued and the trainer's stream waits on the engine's event, so neither CPU waits for the
copy; otherwise (host memory on either side, ``complete="host"``) the engine synchronizes
before it acks.  The signals travel through a shared-memory mailbox per link
(``transport.mailbox``) where the engine could map it, else through the sync group.  A
tensor that moved since export (offloaded and reloaded, reallocated)
bumps the generation: the trainer re-exports and the engine re-maps before reading, so a
stale mapping is never read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from shardsync.plan.plan import Copy
from shardsync.plan.runs import SIDE_STREAMS, Copies, Run, coalesce, compile_runs
from shardsync.runtime.gated import Gated, ungated, window_of
from shardsync.runtime.stats import Stats, StepTiming
from shardsync.store.keys import Keys
from shardsync.store.sealed import seal, unseal
from shardsync.topology import Topology
from shardsync.transport import events
from shardsync.transport.group import SyncGroup
from shardsync.transport.handles import export_tensors, open_set, open_tensor
from shardsync.transport.mailbox import ACK as ACK_SLOT
from shardsync.transport.mailbox import HEADER, Mailbox
from shardsync.transport.pinning import HostPins
from shardsync.vocab import Refused

log = logging.getLogger(__name__)

READY, FAILED, QUEUED, REFUSED = 1, 0, 2, 3  # ack status; QUEUED: complete at the ack's event
ACK = 2 + events.WORDS  # generation, status, then the engine's event (QUEUED)
ABORT = -1  # generation sent when the sender cannot offer its tensors this update
MAILBOX, GROUP = "mailbox", "group"  # how a link signals (its engine end chose at connect)


def identity(t: torch.Tensor) -> tuple:
    """What an exported tensor must keep for the mapping to stay valid.

    CUDA: its address (torch keeps a block an importer still maps out of the allocator, so a
    reallocated tensor gets a new address).  CPU: also its shared-memory name, since a new
    allocation may land on the address a freed mapping had.
    """
    if t.is_cuda:
        return (t.data_ptr(),)
    if not t.is_shared():
        return (t.data_ptr(), None)
    try:
        return (t.data_ptr(), t.untyped_storage()._share_filename_cpu_()[1])
    except RuntimeError:  # shared by another mechanism (file descriptor): not our export
        return (t.data_ptr(), None)


_DATA_PTR = torch.Tensor.data_ptr


def addresses(local: Mapping[str, torch.Tensor], names: Iterable[str]) -> list[int]:
    """The data addresses of ``names`` in ``local`` (~0.15-0.5 us a tensor: the per-update moved check)."""
    return list(map(_DATA_PTR, map(local.__getitem__, names)))


def _cuda_device(tensors) -> torch.device | None:
    return next((t.device for t in tensors if t.is_cuda), None)


# -- the transport --

_Transport = TypeVar("_Transport", bound="MappedTransport")


class MappedTransport:
    """Both ends of the one-sided p2p path for one sync rank.

    Collective contract: every sender calls ``export`` before any receiver calls ``attach``
    (both at join); then every update, senders and receivers call ``run`` with the same plan.
    """

    def __init__(self, group: SyncGroup, copies: Sequence[Copy], *, sender: bool, peers: Sequence[int],
                 prefix: str, itemsize: int, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 trainers: int = 0, secret: str | None = None, stream: bool = True, mailbox: bool = True) -> None:
        """``copies``: this rank's copies of the p2p plan (as source or as destination);
        ``peers``: sync ranks of the other ends, in the order both sides walk them;
        ``shapes``: the sender's tensor shapes the plan was built for (checked at export);
        ``stream`` (sender): let engines ack once their copies are queued on the GPU;
        ``mailbox`` (sender): offer each engine rank a shared-memory mailbox for the signals."""
        self.group, self.sender, self.prefix, self.secret = group, sender, prefix, secret
        self.stream, self.mailbox = stream, mailbox
        self._written: torch.cuda.Event | None = None  # sender: recorded after its writes
        self._device: torch.device | None = None  # sender: where its exported tensors live
        self._done: torch.cuda.Event | None = None  # receiver: recorded after its copies
        self._done_words: list[int] = []  # ... and its handle as ack words (the same every update)
        self._peer_written: dict[int, torch.cuda.Event] = {}  # receiver: each sender's event
        self._opened = events.Opened()
        self.shapes = dict(shapes or {})
        self._trainers = trainers  # sync ranks below this are trainer ranks
        self.copies = list(copies)
        self.peers = list(peers)
        self.generation = 0
        self._exported: dict[str, tuple] = {}
        self._addresses: list[int] | None = None  # every exported tensor's address (all CUDA): the fast check
        self.shm_names: set[str] = set()  # of exported CPU storages
        self._mapped: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # peer -> (generation, tensors)
        self._copies: dict[int, dict[int, tuple[object, tuple[Copies, Copies]]]] = {}  # peer -> id(local) -> copies
        self._runs: dict[int, list[Run]] = {}
        self._streams: list = []  # side streams of the receiver's copies (CUDA)
        self._pins: dict[int, HostPins] = {}  # peer -> its CPU storages, page-locked here for H2D copies
        self.nbytes = sum(c.numel for c in self.copies) * itemsize  # on the wire dtype
        self.peer_bytes = {p: 0 for p in self.peers}
        self._boxes: dict[int, Mailbox] = {}  # peer -> the link's mailbox (sender: made at first export)
        self._signals: dict[int, str] = {}  # sender: peer -> MAILBOX | GROUP, read at the first update
        self._number = 0  # sender: updates signalled
        self._taken: dict[int, int] = {}  # receiver: peer -> number of the last header taken
        for c in self.copies:
            self.peer_bytes[self._other(c)] += c.numel * itemsize

    def _other(self, c: Copy) -> int:
        """The sync rank at the other end of copy ``c`` (trainer ranks come first)."""
        return self._trainers + c.dst if self.sender else c.src

    @classmethod
    def for_rank(cls: type[_Transport], group: SyncGroup, topo: Topology, prefix: str, secret: str | None = None,
                 stream: bool = True, mailbox: bool = True, **extra) -> _Transport:
        """Sync rank ``group.rank``'s end of ``topo``'s p2p plan (trainer ranks send)."""
        me, trainers = group.rank, topo.trainer.world_size
        plan = topo.p2p_plan
        if me < trainers:
            copies = [c for c in plan.copies if c.src == me]
            peers = sorted({trainers + c.dst for c in copies})
        else:
            copies = [c for c in plan.copies if c.dst == me - trainers]
            peers = sorted({c.src for c in copies})
        shapes = {t.name: tuple(t.shape) for t in plan.src.ranks[me].tensors} if me < trainers else None
        return cls(group, copies, sender=me < trainers, peers=peers, prefix=prefix,
                   itemsize=plan.itemsize, shapes=shapes, trainers=trainers, secret=secret, stream=stream,
                   mailbox=mailbox, **extra)

    def _key(self, src: int, dst: int, generation: int) -> str:
        return Keys(self.prefix).mapped(src, dst, generation)

    # -- sender --

    def export(self, local: Mapping[str, torch.Tensor]) -> None:
        """Publish handles of the tensors this rank's copies read (generation bumps per call)."""
        names = sorted({c.src_local for c in self.copies})
        tensors = {n: local[n] for n in names}
        wrong = [f"{n} {tuple(t.shape)} (plan: {self.shapes[n]})" for n, t in tensors.items()
                 if n in self.shapes and tuple(t.shape) != self.shapes[n]]
        if wrong:  # copies would run out of bounds: refuse before anything is published
            raise ValueError(f"tensor(s) changed shape since connect: {', '.join(wrong[:3])}; "
                             "restore the shapes or reconnect with the new model")
        self.generation += 1
        self._device = _cuda_device(tensors.values())
        written = None
        if self._device is not None:
            if self._written is None:
                self._written = events.new_event()
            self._written.record(torch.cuda.current_stream(self._device))  # creates it on that device
            written = events.handle_of(self._written, self._device)
        for peer in self.peers:  # one handle set per reader: each holds one reference
            key = self._key(self.group.rank, peer, self.generation)
            box = Mailbox.words() if self.mailbox and self.generation == 1 else None  # the first set carries it
            self.group.store.set(key, seal(key, export_tensors(self._offered(tensors), written, box), self.secret))
            if box is not None:
                self._boxes[peer] = Mailbox(box)  # exporting moved it into shared memory
                self.shm_names.add(identity(box)[1].decode())
        self._exported = {n: identity(t) for n, t in tensors.items()}
        self._addresses = [t.data_ptr() for t in tensors.values()] if all(t.is_cuda for t in tensors.values()) else None
        # shared-memory names (CPU): torch removes them when the last process unmaps
        self.shm_names.update(i[1].decode() for i in self._exported.values() if len(i) == 2 and i[1])

    def _offered(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What the engines map of the tensors the copies read: all of them (they copy)."""
        return tensors

    def _export_moved(self, local: Mapping[str, torch.Tensor]) -> None:
        """Sender: export again if a tensor moved since the last export (a stale mapping is never read)."""
        moved = self._moved(local)
        if moved:
            log.info("rank %d: %d exported tensor(s) moved since export (e.g. %s): exporting them again",
                     self.group.rank, len(moved), moved[0])
            self.export(local)

    def _moved(self, local: Mapping[str, torch.Tensor]) -> list[str]:
        if self._addresses is not None and addresses(local, self._exported) == self._addresses:
            return []  # device tensors: an address is the whole identity (one list compare per update)
        return self._moved_of(local, self._exported)

    def _moved_of(self, local: Mapping[str, torch.Tensor], names) -> list[str]:
        """Those of ``names`` whose identity changed since export (host tensors: the shm name too)."""
        return [k for k in names if identity(local[k]) != self._exported[k]]

    # -- receiver --

    def attach(self, peer: int, generation: int, local: Mapping[str, torch.Tensor]) -> None:
        """Map ``peer``'s tensors of ``generation`` and compile the copies read from them."""
        key = self._key(peer, self.group.rank, generation)
        self.group.store.wait([key], self.group.rdv.timeout)
        self._copies.pop(peer, None)
        self._mapped.pop(peer, None)  # the old mapping is released before the new one opens
        self._pins.pop(peer, HostPins()).release()
        mapped, written, box = open_set(unseal(key, self.group.store.get(key), self.secret), where=f"store key {key}")
        if peer not in self._taken:  # the link's first set: choose how it signals
            self._open_mailbox(peer, box)
        self._peer_written.pop(peer, None)
        if written is not None:
            self._peer_written[peer] = self._opened.of_handle(written)
        if any(t.is_cuda for t in ungated(local).values()):
            self._pins[peer] = HostPins()
            self._pins[peer].pin(mapped.values())
        if peer not in self._runs:
            self._runs[peer] = coalesce([c for c in self.copies if c.src == peer])
        self._mapped[peer] = (generation, mapped)
        self._copies[peer] = {}
        self._compiled(peer, local)

    def _open_mailbox(self, peer: int, handle) -> None:
        """Map the link's mailbox (if offered) and tell the sender which way this end signals."""
        self._taken[peer] = 0
        how = GROUP
        if handle is not None:
            try:
                self._boxes[peer] = Mailbox(open_tensor(handle))
                how = MAILBOX
            except Exception as e:  # another /dev/shm or shm manager than the trainer's
                log.info("sync rank %d: cannot map sync rank %d's mailbox (%s): signalling over the sync group",
                         self.group.rank, peer, e)
        key = Keys(self.prefix).signals(peer, self.group.rank)
        self.group.store.set(key, seal(key, how, self.secret))

    def _compiled(self, peer: int, local: Mapping[str, torch.Tensor]) -> tuple[Copies, Copies]:
        """The copies from ``peer``'s mapped tensors into ``local``, compiled once per local
        mapping (a staged engine alternates two): (into staging, into served weights).  The
        second is empty unless ``local`` stages a window (``runtime.gated``)."""
        hit = self._copies[peer].get(id(local))
        if hit is None or hit[0] is not local:
            window = window_of(local)
            runs, src = self._runs[peer], self._mapped[peer][1]
            if window is None:
                compiled = (Copies.of(compile_runs(runs, src, local)), Copies.of([]))
            else:
                views = ungated(local)
                into_staging, into_served = (
                    Copies.of(compile_runs([r for r in runs if (r.first.dst_local in window) == staged], src, views))
                    for staged in (True, False))
                compiled = (into_staging, into_served)
            hit = (local, compiled)
            self._copies[peer][id(local)] = hit
        return hit[1]

    def _side_streams(self, device: torch.device | None) -> list:
        if device is None or device.type != "cuda":
            return []
        if not self._streams:
            self._streams = [torch.cuda.Stream(device) for _ in range(SIDE_STREAMS)]
        return self._streams

    def detach(self) -> None:
        self._copies.clear()
        self._peer_written.clear()
        self._opened.clear()
        for pins in self._pins.values():
            pins.release()
        self._pins.clear()
        self._mapped.clear()
        if not self.sender:
            self._boxes.clear()
            self._taken.clear()

    # -- one update --

    def run(self, local: Mapping[str, torch.Tensor]) -> Stats:
        return self._send(local) if self.sender else self._receive(local)

    def _send(self, local: Mapping[str, torch.Tensor]) -> Stats:
        stats = Stats()
        t0 = time.perf_counter()
        error = None
        try:
            self._export_moved(local)
            self._mark_written()  # the engines read only after every write to the weights
        except Exception as e:  # tell the engines now rather than let them wait for a timeout
            error = e
        acks = self._signal([ABORT if error else self.generation, int(self.stream)])
        t1 = time.perf_counter()
        acks = [a() for a in acks]
        for a in acks:  # before any error is raised: the weights stay unwritten until the reads end
            if a[1] == QUEUED:
                self._after_reads(a[2:])
        stats.pack_s = t1 - t0
        stats.transfer_s = time.perf_counter() - t1
        return self._judged(stats, acks, error)

    def _judged(self, stats: Stats, acks: list[list[int]], error: Exception | None) -> Stats:
        """Sender: the update's stats, or the error it ends with (its own first, then the engines')."""
        if error is not None:
            raise error
        stats.steps = [StepTiming("map", f"{self.group.rank}->{p}", self.peer_bytes[p], transfer_s=stats.transfer_s)
                       for p in self.peers]
        refused = [p for a, p in zip(acks, self.peers, strict=True) if a[1] == REFUSED]
        if refused:
            raise Refused(f"sync rank(s) {refused} refused this update before reading (the engine's answer says why)")
        failed = [p for a, p in zip(acks, self.peers, strict=True) if a[1] not in (READY, QUEUED)]
        if failed:
            raise RuntimeError(f"sync rank(s) {failed} failed reading this rank's mapped tensors")
        stats.bytes_sent = self.nbytes
        return stats

    def _signal(self, header: list[int], extra: Mapping[int, list[int]] | None = None) -> list:
        """Sender: post ``header`` (and ``extra[peer]`` after it) to every engine rank; one
        callable per peer returns its ack."""
        self._number += 1
        number, timeout = self._number, self.group.rdv.timeout_s
        acks: list[Callable[[], list[int]]] = []
        for peer in self.peers:
            words = header + list((extra or {}).get(peer, ()))
            if self._signal_of(peer) == MAILBOX:
                box = self._boxes[peer]
                box.post(HEADER, number, words)

                def box_ack(box=box, peer=peer) -> list[int]:
                    got, words = box.take(ACK_SLOT, ACK, after=number - 1, timeout_s=timeout,
                                          what=f"ack of update {number} from sync rank {peer}")
                    if got != number:
                        raise RuntimeError(f"sync rank {peer} acked update {got}, expected {number}")
                    return words

                acks.append(box_ack)
            else:
                send = self.group.send(torch.tensor(words, dtype=torch.int64), peer)
                buf = torch.zeros(ACK, dtype=torch.int64)
                recv = self.group.recv(buf, peer)

                def group_ack(send=send, recv=recv, buf=buf) -> list[int]:
                    send.wait()
                    recv.wait()
                    return buf.tolist()

                acks.append(group_ack)
        return acks

    def _signal_of(self, peer: int) -> str:
        how = self._signals.get(peer)
        if how is None:
            key = Keys(self.prefix).signals(self.group.rank, peer)
            self.group.store.wait([key], self.group.rdv.timeout)
            raw = unseal(key, self.group.store.get(key), self.secret)
            how = raw.decode() if isinstance(raw, bytes) else raw
            if how not in (MAILBOX, GROUP) or (how == MAILBOX and peer not in self._boxes):
                raise ValueError(f"store key {key} holds {how[:40]!r}, not {MAILBOX!r} or {GROUP!r}")
            self._signals[peer] = how
        return how

    HEADER_WORDS = 2  # generation, stream

    def _header(self, peer: int) -> list[int]:
        """Receiver: ``peer``'s next header [generation, stream]."""
        box = self._boxes.get(peer)
        if box is None:
            header = torch.zeros(self.HEADER_WORDS, dtype=torch.int64)
            self.group.recv(header, peer).wait()
            return header.tolist()
        got, words = box.take(HEADER, self.HEADER_WORDS, after=self._taken.get(peer, 0),
                              timeout_s=self.group.rdv.timeout_s,
                              what=f"update signal from trainer sync rank {peer}")
        self._taken[peer] = got
        return words

    def _answer(self, peer: int, ack: list[int]) -> None:
        box = self._boxes.get(peer)
        if box is None:
            self.group.send(torch.tensor(ack, dtype=torch.int64), peer).wait()
        else:
            box.post(ACK_SLOT, self._taken[peer], ack)

    def _mark_written(self) -> None:
        """Sender: where the engines' copies start (its stream's writes before this point)."""
        if self._written is not None and self._device is not None:  # host tensors: nothing queued
            self._written.record(torch.cuda.current_stream(self._device))

    def _after_reads(self, words: list[int]) -> None:
        """Sender: later writes of its stream wait for an engine's queued copies."""
        done = self._opened.of_words(words)
        if self._device is None:
            done.synchronize()
        else:
            torch.cuda.current_stream(self._device).wait_event(done)

    def _after_writes(self, peer: int, device: torch.device | None) -> None:
        """Receiver: this rank's copies from ``peer`` start after the sender's writes."""
        written = self._peer_written.get(peer)
        if written is None or written.query():  # nothing recorded, or the writes already ran
            return
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(written)
        else:
            written.synchronize()

    def _complete(self, device: torch.device | None, queued: bool) -> list[int]:
        """Receiver: after the copies queued so far - the event words of a QUEUED ack, or []
        once the CPU waited for them (READY)."""
        if device is None or device.type != "cuda":
            return []
        if queued:
            if self._done is None:
                self._done = events.new_event()
            self._done.record(torch.cuda.current_stream(device))  # the first record creates it
            if not self._done_words:
                self._done_words = events.words(self._done, device)
            return self._done_words
        torch.cuda.current_stream(device).synchronize()
        return []

    def _receive(self, local: Mapping[str, torch.Tensor]) -> Stats:
        """Every sender gets its ack, even after another one failed: none waits for a timeout.

        Staging copies of every peer go first; copies into served weights (a staging window's
        rest) follow once ``local.open()`` paused the engine."""
        stats = Stats()
        error: Exception | None = None
        gens, waits, queued = {}, {}, {}
        for peer in self.peers:
            t0 = time.perf_counter()
            gen, stream = self._header(peer)
            gens[peer] = gen
            queued[peer] = bool(stream)
            waits[peer] = time.perf_counter() - t0
            try:
                if self._mapped_for(peer, gen, local, error):
                    staged, live = self._compiled(peer, local)
                    queued[peer] &= staged.on_device and live.on_device
                    self._after_writes(peer, staged.device or live.device)
                    staged.run(self._side_streams(staged.device))
            except Exception as e:
                error = error or e
        if error is None and any(self._compiled(p, local)[1].device is not None for p in self.peers):
            try:
                device = next(c.device for p in self.peers for c in self._compiled(p, local) if c.device is not None)
                if device.type == "cuda":  # the staging copies run while serving, not in the pause
                    torch.cuda.current_stream(device).synchronize()
                assert isinstance(local, Gated), "copies into served weights exist only for a staging window"
                local.open()  # the engine pauses: the rest writes what it serves
            except Exception as e:
                error = e
        for peer in self.peers:
            t1 = time.perf_counter()
            status, done = FAILED, []
            try:
                if error is None:
                    staged, live = self._compiled(peer, local)
                    live.run(self._side_streams(live.device))
                    done = self._complete(staged.device or live.device, queued[peer])
                    status = QUEUED if done else READY
            except Exception as e:
                error = error or e
            self._answer(peer, [gens[peer], status, *(done or [0] * events.WORDS)])
            t2 = time.perf_counter()
            stats.transfer_s += waits[peer]
            stats.unpack_s += t2 - t1
            stats.steps.append(StepTiming("map", f"{peer}->{self.group.rank}", self.peer_bytes[peer],
                                          transfer_s=waits[peer], unpack_s=t2 - t1))
        if error is not None:
            raise error
        stats.bytes_received = self.nbytes
        return stats

    def _mapped_for(self, peer: int, gen: int, local: Mapping[str, torch.Tensor], error: Exception | None) -> bool:
        """Receiver: whether ``peer``'s part of this update proceeds (no earlier error), its
        generation mapped; an abort the sender signalled raises."""
        if gen == ABORT:
            raise RuntimeError(f"trainer sync rank {peer} aborted the update before sending")
        if error is not None:
            return False
        if self._mapped.get(peer, (None,))[0] != gen:
            self.attach(peer, gen, local)
        return True

    def refuse(self) -> None:
        """Receiver: answer an update the engine refused (a pipelined begin: the trainer's
        signal is on its way): take each sender's header, ack ``REFUSED``, touch nothing."""
        for peer in self.peers:
            self._answer(peer, [self._header(peer)[0], REFUSED] + [0] * events.WORDS)

    # -- Transport (control messages only) --

    def synchronize(self) -> None:
        self.group.synchronize()

    def barrier(self) -> None:
        self.group.barrier()
