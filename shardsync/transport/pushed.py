"""Push: the colocated trainer writes each engine rank's staging copy itself, so the copies
start when ``update()`` is called instead of after the engine woke up, checked the begin and
ran its receive (~0.7 ms on the H200 host, the whole gap of the map path to its copy limit).

The engine stages whole shards (``receiver.destination.Staged``) and exports every staging set
once, with an interprocess event (its commit fence); the trainer maps them and compiles its
copies into each set.  Which set the next update writes is the engine's word: after every
commit or refusal it posts a numbered record ``[set]`` in the link's mailbox (slot
``STAGED``), and the trainer writes update ``n`` only after it read the record numbered ``n``
- the engine is done with every earlier update, so the set it names is not the one served.
The trainer's stream waits on the fence (steps queued before the commit no longer read that
set), copies, records its own event and signals ``[generation, stream, set]``; the engine
checks the set, acks, and its commit swaps the set in, ordering what it serves next after
the trainer's event on the GPU (``Staged.ready_at``).  A refused or failed update wrote only
staging: the served weights are untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from shardsync.plan.runs import Copies, coalesce, compile_runs
from shardsync.runtime.stats import Stats, StepTiming
from shardsync.store.keys import Keys
from shardsync.store.sealed import seal, unseal
from shardsync.transport import events
from shardsync.transport.handles import export_tensors, open_set
from shardsync.transport.mailbox import STAGED
from shardsync.transport.mapped import (
    ABORT,
    FAILED,
    READY,
    REFUSED,
    MappedTransport,
    addresses,
)

log = logging.getLogger(__name__)


@dataclass
class Staging:
    """An engine rank's staging copies as a pushing trainer writes them."""

    sets: list[Mapping[str, torch.Tensor]]  # every mapping a receive may write (the layout's views)
    index: Callable[[], int]  # which of ``sets`` the next receive writes
    ready_at: Callable[[torch.cuda.Event], None]  # the commit orders the served stream after it
    fence: Callable[[], torch.cuda.Event | None]  # recorded after every commit (CUDA shards)


class PushedTransport(MappedTransport):
    """Both ends of the push path for one sync rank (same contract as ``MappedTransport``;
    engine ranks need ``staging``)."""

    HEADER_WORDS = 3  # generation, stream, the staging set written

    def __init__(self, *args, staging: Staging | None = None, **kw) -> None:
        super().__init__(*args, **kw)
        if not self.sender and staging is None:
            raise ValueError("an engine rank receives pushed updates into staging: pass its Staging")
        self.staging = staging
        self._targets: dict[int, tuple[list[dict[str, torch.Tensor]], torch.cuda.Event | None]] = {}
        # trainer: peer -> (local, copies per set: from the largest tensor, from the rest)
        self._pushes: dict[int, tuple[object, list[tuple[Copies, ...]]]] = {}
        # trainer: (number, local, peer -> set, error, seconds) of ``launch``
        self._launched: tuple[int, Mapping[str, torch.Tensor], dict[int, int], Exception | None, float] | None = None

    # -- trainer --

    def _offered(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {}  # nothing of the trainer's is mapped: the engine only needs the event and the mailbox

    def export(self, local: Mapping[str, torch.Tensor]) -> None:
        super().export(local)
        self._pushes.clear()  # tensors moved (or first export): compile the copies from where they are
        names = list(self._exported)
        lead = max(names, key=lambda n: local[n].numel() * local[n].element_size(), default=None)
        self._parts = ([n for n in names if n == lead], [n for n in names if n != lead])
        self._part_addresses = None if self._addresses is None else tuple(
            addresses(local, part) for part in self._parts)

    def _part_moved(self, local: Mapping[str, torch.Tensor], part: int) -> bool:
        """Whether a tensor of ``part`` (0: the largest, 1: the rest) moved since export."""
        names = self._parts[part]
        if self._part_addresses is not None:  # device tensors: the address is the identity
            return addresses(local, names) != self._part_addresses[part]
        return bool(self._moved_of(local, names))

    def _target(self, peer: int) -> tuple[list[dict[str, torch.Tensor]], torch.cuda.Event | None]:
        """``peer``'s staging sets and commit fence, mapped at the first update."""
        hit = self._targets.get(peer)
        if hit is None:
            key = Keys(self.prefix).staging(peer, self.group.rank)
            self.group.store.wait([key], self.group.rdv.timeout)
            tensors, fence, _ = open_set(unseal(key, self.group.store.get(key), self.secret),
                                         where=f"store key {key}")
            sets: list[dict[str, torch.Tensor]] = []
            for name, t in tensors.items():
                index, _, local = name.partition("/")
                if not index.isdigit() or int(index) > len(sets) or not local:
                    raise ValueError(f"store key {key} names {name!r}, not '<set>/<tensor>' in set order")
                if int(index) == len(sets):
                    sets.append({})
                sets[int(index)][local] = t
            hit = self._targets[peer] = (sets, None if fence is None else self._opened.of_handle(fence))
        return hit

    def _push_copies(self, peer: int, local: Mapping[str, torch.Tensor]) -> list[tuple[Copies, ...]]:
        """Per staging set: the copies from the largest tensor, then the rest (two launches)."""
        hit = self._pushes.get(peer)
        if hit is None or hit[0] is not local:
            if peer not in self._runs:
                self._runs[peer] = coalesce([c for c in self.copies if self._other(c) == peer])
            lead = set(self._parts[0])
            parts = ([r for r in self._runs[peer] if r.first.src_local in lead],
                     [r for r in self._runs[peer] if r.first.src_local not in lead])
            sets, _ = self._target(peer)
            hit = self._pushes[peer] = (local, [tuple(Copies.of(compile_runs(p, local, s)) for p in parts)
                                                for s in sets])
        return hit[1]

    def _staged_set(self, peer: int, number: int, sets: int) -> int:
        """The set ``peer`` stages update ``number`` into, once it is done with every earlier one."""
        got, (index,) = self._boxes[peer].take(STAGED, 1, after=number - 1, timeout_s=self.group.rdv.timeout_s,
                                               what=f"sync rank {peer}'s staging set for update {number}")
        if got != number or not 0 <= index < sets:
            raise RuntimeError(f"sync rank {peer} posted staging set {index} for update {got}, expected a set "
                               f"below {sets} for update {number}")
        return index

    def _copy(self, peer: int, local: Mapping[str, torch.Tensor], index: int, parts: tuple[int, ...],
              fenced: bool) -> None:
        """Queue ``parts`` of the copies into ``peer``'s set ``index`` (``fenced``: first wait
        until the engine's steps stopped reading that set)."""
        copies = self._push_copies(peer, local)[index]
        device = next((c.device for c in copies if c.device is not None), None)
        if device is None or device.type != "cuda":
            for p in parts:
                copies[p].run()
            return
        mine = self._device if self._device is not None and self._device != device else None
        if mine is not None:  # the copies run on the engine's device: after our writes
            torch.cuda.current_stream(device).wait_stream(torch.cuda.current_stream(mine))
        fence = self._target(peer)[1]
        if fenced and fence is not None and not fence.query():
            torch.cuda.current_stream(device).wait_event(fence)
        for p in parts:
            copies[p].run(self._side_streams(device))
        if mine is not None:
            torch.cuda.current_stream(mine).wait_stream(torch.cuda.current_stream(device))

    def launch(self, local: Mapping[str, torch.Tensor]) -> None:
        """Start this update's copies now, before the engines hear of it (``WeightSync.update``
        calls it ahead of the begin): the next ``run`` signals them.  Never raises: an error
        goes to the engines as an abort at ``run``.  Harmless if no ``run`` follows (a refused
        begin): only staging was written, and the next update writes the same set again.

        A copy never reads a tensor that moved since export, yet the check (~0.15-0.4 ms for a
        model's few hundred tensors on the H200 hosts) need not delay the first byte: the
        largest tensor is checked and copied first, the rest checked while it copies."""
        number, error = self._number + 1, None
        sets: dict[int, int] = {}
        t0 = time.perf_counter()
        try:
            if self._part_moved(local, 0):
                self._export_moved(local)  # and the copies compiled again from the new memory
            for peer in self.peers:
                sets[peer] = self._staged_set(peer, number, len(self._push_copies(peer, local)))
                self._copy(peer, local, sets[peer], (0,), fenced=True)
            if self._part_moved(local, 1):  # the lead copies read unmoved memory: rewritten, same bytes
                self._export_moved(local)
                for peer in self.peers:
                    self._copy(peer, local, sets[peer], (0, 1), fenced=False)
            else:
                for peer in self.peers:
                    self._copy(peer, local, sets[peer], (1,), fenced=False)
            self._mark_written()  # the engines' commits order their served streams after this
            if not self.stream and self._device is not None:
                torch.cuda.current_stream(self._device).synchronize()  # complete="host": the copies are done
        except Exception as e:
            error = e
        self._launched = (number, local, sets, error, time.perf_counter() - t0)

    def _send(self, local: Mapping[str, torch.Tensor]) -> Stats:
        stats = Stats()
        t0 = time.perf_counter()
        launched, self._launched = self._launched, None
        if launched is None or launched[0] != self._number + 1 or launched[1] is not local:
            self.launch(local)  # not launched ahead (or for another update): now
            launched, self._launched = self._launched, None
        assert launched is not None, "launch records its outcome (it never raises)"
        _, _, sets, error, pushed_s = launched
        header = [ABORT if error else self.generation, int(self.stream and self._device is not None)]
        acks = self._signal(header, {p: [sets.get(p, -1)] for p in self.peers})
        t1 = time.perf_counter()
        acks = [a() for a in acks]
        stats.pack_s = t1 - t0 + pushed_s  # the copies' launch (ahead of the begin or here) and the signal
        stats.transfer_s = time.perf_counter() - t1
        return self._judged(stats, acks, error)

    # -- engine --

    def attach(self, peer: int, generation: int, local: Mapping[str, torch.Tensor]) -> None:
        """Open ``peer``'s event (and, the first time, its mailbox); offer it the staging sets."""
        key = self._key(peer, self.group.rank, generation)
        self.group.store.wait([key], self.group.rdv.timeout)
        tensors, written, box = open_set(unseal(key, self.group.store.get(key), self.secret), where=f"store key {key}")
        if tensors:
            raise ValueError(f"store key {key} offers {len(tensors)} tensor(s); a pushing trainer maps, it offers none")
        first = peer not in self._taken
        if first:
            self._open_mailbox(peer, box)
            if peer not in self._boxes:
                raise RuntimeError(f"sync rank {self.group.rank} cannot map trainer sync rank {peer}'s mailbox, "
                                   "which ipc='push' needs (another /dev/shm?): connect with ipc='map'")
        self._peer_written.pop(peer, None)
        if written is not None:
            self._peer_written[peer] = self._opened.of_handle(written)
        self._mapped[peer] = (generation, {})
        if first:
            self._offer(peer)

    def _offer(self, peer: int) -> None:
        assert self.staging is not None, "an engine rank has its staging (checked at construction)"
        names = sorted({c.dst_local for c in self.copies if c.src == peer})
        tensors = {f"{i}/{n}": s[n] for i, s in enumerate(self.staging.sets) for n in names}
        fence = self.staging.fence()
        handle = None if fence is None else events.handle_of(fence, next(t.device for t in tensors.values()))
        key = Keys(self.prefix).staging(self.group.rank, peer)
        self.group.store.set(key, seal(key, export_tensors(tensors, handle), self.secret))
        self._post_staged(peer)

    def _post_staged(self, peer: int) -> None:
        """Tell ``peer`` which set its next update writes (numbered: the update after the last taken)."""
        assert self.staging is not None, "an engine rank has its staging (checked at construction)"
        self._boxes[peer].post(STAGED, self._taken[peer] + 1, [self.staging.index()])

    def _receive(self, local: Mapping[str, torch.Tensor]) -> Stats:
        """Every sender gets its ack, even after another one failed: none waits for a timeout."""
        stats = Stats()
        error: Exception | None = None
        staging = self.staging
        assert staging is not None, "an engine rank has its staging (checked at construction)"
        for peer in self.peers:
            t0 = time.perf_counter()
            gen, stream, index = self._header(peer)
            status = FAILED
            try:
                if self._mapped_for(peer, gen, local, error):
                    if index != staging.index():
                        raise RuntimeError(f"trainer sync rank {peer} wrote staging set {index}; this rank "
                                           f"stages into set {staging.index()}")
                    written = self._peer_written.get(peer)
                    if stream and written is not None:
                        staging.ready_at(written)  # the commit waits for the copies on the GPU
                    status = READY
            except Exception as e:
                error = error or e
            self._answer(peer, [gen, status] + [0] * events.WORDS)
            wait = time.perf_counter() - t0
            stats.transfer_s += wait
            stats.steps.append(StepTiming("push", f"{peer}->{self.group.rank}", self.peer_bytes[peer], transfer_s=wait))
        if error is not None:
            raise error
        stats.bytes_received = self.nbytes
        return stats

    def committed(self) -> None:
        """The engine committed: each trainer may write the set staged next."""
        for peer in self.peers:
            if peer in self._boxes and peer in self._taken:  # attached (not left)
                self._post_staged(peer)

    def refuse(self) -> None:
        for peer in self.peers:
            self._answer(peer, [self._header(peer)[0], REFUSED] + [0] * events.WORDS)
            self._post_staged(peer)  # nothing was committed: the same set again

    def detach(self) -> None:
        super().detach()
        self._targets.clear()
        self._pushes.clear()

