"""One-sided transport for engines on the trainer's machine: the engine reads the trainer's
tensors in place, through CUDA IPC (same GPU or peer GPUs of one node) or CPU shared memory.

The trainer exports its tensors once (handles through the rendezvous store); each engine
rank maps them once and compiles its share of the p2p plan into (destination view, mapped
source view) copies, strided where a per-group pattern allows.  An update moves every byte
once: the trainer synchronizes its stream and signals ``[generation]``; the engine copies,
synchronizes and acks; the trainer returns only after every ack, so its tensors are never
written while an engine reads them.  A tensor that moved since export (offloaded and
reloaded, reallocated) bumps the generation: the trainer re-exports and the engine re-maps
before reading, so a stale mapping is never read.
"""

from __future__ import annotations

import io
import logging
import pickle
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as tmp

from shardsync.plan.plan import Copy
from shardsync.runtime.executor import ExecStats, StepTiming
from shardsync.topology import Topology
from shardsync.transport.group import SyncGroup

log = logging.getLogger(__name__)

READY, FAILED = 1, 0
ABORT = -1  # generation sent when the sender cannot offer its tensors this update


# -- handles --

def share(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """Handles another process on this machine opens with ``open_shared``.

    CPU tensors move into shared memory first (same values, new storage, in place for every
    view of it); CUDA tensors are exported as they are.
    """
    previous = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # names, not file descriptors: fits in a store value
    try:
        for t in tensors.values():
            if not t.is_cuda:
                t.share_memory_()
        out = io.BytesIO()
        ForkingPickler(out, pickle.HIGHEST_PROTOCOL).dump(dict(tensors))
        return out.getvalue()
    finally:
        tmp.set_sharing_strategy(previous)


def open_shared(blob: bytes) -> dict[str, torch.Tensor]:
    return pickle.loads(blob)


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


# -- compiled copies --

@dataclass(frozen=True)
class Run:
    """``n`` copies of one shape whose offsets advance by a constant step along dim 0."""

    first: Copy
    n: int
    src_step: int
    dst_step: int


def coalesce(copies: Sequence[Copy]) -> list[Run]:
    """Fuse copies between the same tensors that repeat with a constant row stride on both
    sides (a QKV shard is 3 runs, not 3 x groups copies): one kernel per run."""
    groups: dict[tuple, list[Copy]] = defaultdict(list)
    for c in copies:
        groups[(c.src, c.src_local, c.dst_local, c.sizes, c.src_offsets[1:], c.dst_offsets[1:])].append(c)
    runs: list[Run] = []
    for group in groups.values():
        group.sort(key=lambda c: c.dst_offsets[0])  # engines concatenate: runs follow the destination
        i = 0
        while i < len(group):
            j = i + 1
            if j < len(group):
                ss = group[j].src_offsets[0] - group[i].src_offsets[0]
                ds = group[j].dst_offsets[0] - group[i].dst_offsets[0]
                if ds >= group[i].sizes[0] and ss >= 0:  # as_strided takes no negative steps
                    while (j < len(group) and group[j].src_offsets[0] - group[j - 1].src_offsets[0] == ss
                           and group[j].dst_offsets[0] - group[j - 1].dst_offsets[0] == ds):
                        j += 1
            if j - i > 1:
                runs.append(Run(group[i], j - i, ss, ds))
            else:
                j = i + 1
                runs.append(Run(group[i], 1, 0, 0))
            i = j
    return runs


def _view(t: torch.Tensor, offsets: tuple[int, ...], sizes: tuple[int, ...], n: int, step: int) -> torch.Tensor:
    base = t.storage_offset() + sum(o * s for o, s in zip(offsets, t.stride(), strict=True))
    if n == 1:
        return t.as_strided(sizes, t.stride(), base)
    return t.as_strided((n, *sizes), (step * t.stride(0), *t.stride()), base)


def _wide(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same bytes as 8-byte words when no dtype conversion happens: a strided copy of
    bf16 rows moves 4x fewer elements (the elementwise copy kernel is per-element bound)."""
    if dst.dtype != src.dtype or dst.element_size() >= 8:
        return dst, src
    try:
        return dst.view(torch.int64), src.view(torch.int64)
    except RuntimeError:  # a row or an offset not a multiple of 8 bytes: keep the dtype
        return dst, src


def compile_runs(runs: Sequence[Run], src: Mapping[str, torch.Tensor],
                 dst: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(destination view, source view) pairs; built once per mapping, reused every update."""
    return [_wide(_view(dst[r.first.dst_local], r.first.dst_offsets, r.first.sizes, r.n, r.dst_step),
                  _view(src[r.first.src_local], r.first.src_offsets, r.first.sizes, r.n, r.src_step))
            for r in runs]


SMALL_BYTES = 1 << 20
SIDE_STREAMS = 3


def copy_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
               streams: Sequence[torch.cuda.Stream] = ()) -> None:
    """Every pair's copy, ordered after and before the current stream's work.

    On CUDA small contiguous copies go in one multi-tensor launch, and the rest are dealt
    round-robin over the current stream and ``streams`` so one copy's tail overlaps the next
    one's start (Qwen3-4B on an H200, ``benchmarks/gpu_update.py``: 1601 -> 1749 GB/s).
    """
    small = [(d, s) for d, s in pairs if d.is_cuda and d.numel() * d.element_size() < SMALL_BYTES
             and d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.device == s.device]
    if len(small) > 1:
        torch._foreach_copy_([d for d, _ in small], [s for _, s in small])
    else:
        small = []
    done = {id(d) for d, _ in small}
    rest = [(d, s) for d, s in pairs if id(d) not in done]
    if not streams or not rest or not rest[0][0].is_cuda:
        for d, s in rest:
            d.copy_(s)
        return
    current = torch.cuda.current_stream(rest[0][0].device)
    k = len(streams) + 1
    for i, side in enumerate(streams, start=1):
        side.wait_stream(current)  # the weights are not read (e.g. by a forward) any more
        with torch.cuda.stream(side):
            for d, s in rest[i::k]:
                d.copy_(s)
    for d, s in rest[0::k]:
        d.copy_(s)
    for side in streams:
        current.wait_stream(side)  # a synchronize of the current stream covers every copy


def _sync(tensors) -> None:
    for t in tensors:
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()
            return


# -- the transport --

class MappedTransport:
    """Both ends of the one-sided p2p path for one sync rank.

    Collective contract: every sender calls ``export`` before any receiver calls ``attach``
    (both at join); then every update, senders and receivers call ``run`` with the same plan.
    """

    one_sided = True

    def __init__(self, group: SyncGroup, copies: Sequence[Copy], *, sender: bool, peers: Sequence[int],
                 prefix: str, itemsize: int, shapes: Mapping[str, tuple[int, ...]] | None = None,
                 trainers: int = 0) -> None:
        """``copies``: this rank's copies of the p2p plan (as source or as destination);
        ``peers``: sync ranks of the other ends, in the order both sides walk them;
        ``shapes``: the sender's tensor shapes the plan was built for (checked at export)."""
        self.group, self.sender, self.prefix = group, sender, prefix
        self.shapes = dict(shapes or {})
        self._trainers = trainers  # sync ranks below this are trainer ranks
        self.copies = list(copies)
        self.peers = list(peers)
        self.generation = 0
        self._exported: dict[str, int] = {}
        self.shm_names: set[str] = set()  # of exported CPU storages
        self._mapped: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}  # peer -> (generation, tensors)
        self._pairs: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._runs: dict[int, list[Run]] = {}
        self._streams: list = []  # side streams of the receiver's copies (CUDA)
        self.nbytes = sum(c.numel for c in self.copies) * itemsize  # on the wire dtype
        self.peer_bytes = {p: 0 for p in self.peers}
        for c in self.copies:
            self.peer_bytes[self._other(c)] += c.numel * itemsize

    def _other(self, c: Copy) -> int:
        """The sync rank at the other end of copy ``c`` (trainer ranks come first)."""
        return self._trainers + c.dst if self.sender else c.src

    @classmethod
    def for_rank(cls, group: SyncGroup, topo: Topology, prefix: str) -> MappedTransport:
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
                   itemsize=plan.itemsize, shapes=shapes, trainers=trainers)

    def _key(self, src: int, dst: int, generation: int) -> str:
        return f"{self.prefix}/map/{src}->{dst}/g{generation}"

    # -- sender --

    def export(self, local: Mapping[str, torch.Tensor]) -> None:
        """Publish handles of the tensors this rank's copies read (generation bumps per call)."""
        names = sorted({c.src_local for c in self.copies})
        tensors = {n: local[n] for n in names}
        wrong = [f"{n} {tuple(t.shape)} (plan: {self.shapes[n]})" for n, t in tensors.items()
                 if n in self.shapes and tuple(t.shape) != self.shapes[n]]
        if wrong:  # engines would read out of bounds: refuse before anything is published
            raise ValueError(f"tensor(s) changed shape since connect: {', '.join(wrong[:3])}; "
                             "restore the shapes or reconnect with the new model")
        self.generation += 1
        for peer in self.peers:  # one pickle per reader: torch balances each pickle with one load
            self.group._store.set(self._key(self.group.rank, peer, self.generation), share(tensors))
        self._exported = {n: identity(t) for n, t in tensors.items()}
        # shared-memory names (CPU): torch removes them when the last process unmaps
        self.shm_names.update(i[1].decode() for i in self._exported.values() if len(i) == 2 and i[1])

    def _moved(self, local: Mapping[str, torch.Tensor]) -> list[str]:
        return [k for k, i in self._exported.items() if identity(local[k]) != i]

    # -- receiver --

    def attach(self, peer: int, generation: int, local: Mapping[str, torch.Tensor]) -> None:
        """Map ``peer``'s tensors of ``generation`` and compile the copies read from them."""
        key = self._key(peer, self.group.rank, generation)
        self.group._store.wait([key], self.group.rdv.timeout)
        self._pairs.pop(peer, None)
        self._mapped.pop(peer, None)  # the old mapping is released before the new one opens
        mapped = open_shared(self.group._store.get(key))
        if peer not in self._runs:
            self._runs[peer] = coalesce([c for c in self.copies if c.src == peer])
        self._mapped[peer] = (generation, mapped)
        self._pairs[peer] = compile_runs(self._runs[peer], mapped, local)

    def _side_streams(self, pairs) -> list:
        if not pairs or not pairs[0][0].is_cuda:
            return []
        if not self._streams:
            self._streams = [torch.cuda.Stream(pairs[0][0].device) for _ in range(SIDE_STREAMS)]
        return self._streams

    def detach(self) -> None:
        self._pairs.clear()
        self._mapped.clear()

    # -- one update --

    def run(self, local: Mapping[str, torch.Tensor]) -> ExecStats:
        return self._send(local) if self.sender else self._receive(local)

    def _send(self, local: Mapping[str, torch.Tensor]) -> ExecStats:
        stats = ExecStats()
        t0 = time.perf_counter()
        error = None
        try:
            moved = self._moved(local)
            if moved:
                log.info("rank %d: %d exported tensor(s) moved since export (e.g. %s): re-exporting",
                         self.group.rank, len(moved), moved[0])
                self.export(local)
            _sync(local.values())  # every write to the weights has landed before anyone reads
        except Exception as e:  # tell the engines now rather than let them wait for a timeout
            error = e
        header = torch.tensor([ABORT if error else self.generation], dtype=torch.int64)
        sends = [self.group.send(header, p) for p in self.peers]
        acks = [torch.zeros(2, dtype=torch.int64) for _ in self.peers]
        works = [self.group.recv(a, p) for a, p in zip(acks, self.peers, strict=True)]
        t1 = time.perf_counter()
        for w in sends + works:
            w.wait()
        stats.pack_s = t1 - t0
        stats.transfer_s = time.perf_counter() - t1
        if error is not None:
            raise error
        stats.steps = [StepTiming("map", f"{self.group.rank}->{p}", self.peer_bytes[p], transfer_s=stats.transfer_s)
                       for p in self.peers]
        failed = [p for a, p in zip(acks, self.peers, strict=True) if int(a[1]) != READY]
        if failed:
            raise RuntimeError(f"sync rank(s) {failed} failed reading this rank's mapped tensors")
        stats.bytes_sent = self.nbytes
        return stats

    def _receive(self, local: Mapping[str, torch.Tensor]) -> ExecStats:
        """Every sender gets its ack, even after another one failed: none waits for a timeout."""
        stats = ExecStats()
        error: Exception | None = None
        for peer in self.peers:
            t0 = time.perf_counter()
            header = torch.zeros(1, dtype=torch.int64)
            self.group.recv(header, peer).wait()
            gen = int(header[0])
            t1 = time.perf_counter()
            status = FAILED
            try:
                if gen == ABORT:
                    raise RuntimeError(f"trainer sync rank {peer} aborted the update before sending")
                if error is None:
                    if self._mapped.get(peer, (None,))[0] != gen:
                        self.attach(peer, gen, local)
                    pairs = self._pairs[peer]
                    copy_pairs(pairs, self._side_streams(pairs))
                    _sync(d for d, _ in pairs)
                    status = READY
            except Exception as e:
                error = error or e
            self.group.send(torch.tensor([gen, status], dtype=torch.int64), peer).wait()
            t2 = time.perf_counter()
            stats.transfer_s += t1 - t0
            stats.unpack_s += t2 - t1
            stats.steps.append(StepTiming("map", f"{peer}->{self.group.rank}", self.peer_bytes[peer],
                                          transfer_s=t1 - t0, unpack_s=t2 - t1))
        if error is not None:
            raise error
        stats.bytes_received = self.nbytes
        return stats

    # -- Transport (control messages only) --

    def synchronize(self) -> None:
        self.group.synchronize()

    def barrier(self) -> None:
        self.group.barrier()
