"""Where a receiver writes: the engine's live parameters in place, a staging copy the
engine keeps serving beside (``Staged``), or the engine's own loader fed checkpoint-format
(HuggingFace-named) slices.

Each exposes engine-layout tensors that every path writes into; ``commit`` runs after a
receive succeeded, before the engine serves the new version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from shardsync.piece import RankLayout
from shardsync.plan.local import region
from shardsync.runtime.gated import Gated
from shardsync.vocab import Commit


class Destination:
    """Where one engine rank's receives land.  A destination that serves from elsewhere than
    it receives into (``Staged``) overrides the hooks; the defaults are a destination that
    receives into what it serves."""

    name: ClassVar[str] = "destination"

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Engine-layout local tensors (``layout.engine`` names) the paths write into."""
        raise NotImplementedError

    def commit(self) -> None:
        """A receive into ``tensors()`` succeeded: make it the engine's weights."""
        return None

    def served(self) -> Mapping[str, torch.Tensor]:
        """What the engine serves from (checksums read these)."""
        return self.tensors()

    def prepare(self, *, overwrites: bool = False) -> None:
        """Before a receive (off the engine's pause): bring ``tensors()`` up to the served
        weights where they lag.  ``overwrites``: the receive was written already (a push)."""
        return None

    def discard(self) -> None:
        """A receive into ``tensors()`` failed: drop what it wrote where that is possible."""
        return None

    def received(self) -> int:
        """A receive into ``tensors()`` succeeded (before ``commit``, off the engine's pause):
        derive what the engine serves from it where that differs (an FP8 engine quantizes);
        returns how many derived elements differ from the served ones (0: nothing derived)."""
        return 0

    def staged(self) -> Staged | None:
        """The staging capability (a copy received while serving, committed between two
        steps), or None where receives land in what is served."""
        return None

    def pushed(self, staging: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """One of ``staged().sets()`` as a pushing trainer writes it (the engine-layout names
        ``tensors()`` has): itself, unless a deriving destination receives into tensors of its own."""
        return staging

    def unpushable(self) -> str | None:
        """Why a pushing trainer (CUDA IPC, writing from its own process) cannot write here;
        None when it can (a whole staging copy)."""
        staged = self.staged()
        if staged is not None and staged.whole:
            return None
        return f"{self.name} ({'a staging window' if staged is not None else 'no staging copy'})"

    def bind(self, rank: RankLayout) -> None:
        """A connection's layout of this rank (at join): the names and dtypes ``tensors()`` is
        addressed by from now on.  Nothing to do where they never change."""
        return None

    def stale(self) -> set[str]:
        """Engine tensors whose served state does not follow from what was received (their
        checksums then mismatch); empty where what is served is what was received."""
        return set()

    def rebind(self, params: Mapping[str, torch.Tensor]) -> bool:
        """Write into ``params`` from now on where the engine rebound a parameter's storage (a
        repacking method may); True when something here followed.  Nothing writes in place here."""
        return False


class Deriving(Destination):
    """A destination that receives into tensors of its own and derives what ``inner`` serves
    from them in ``received`` (an FP8 engine quantizes, a merging LoRA engine merges): the
    commit lifecycle is the inner destination's (in place, or its staging copy swapped in)."""

    def __init__(self, inner: Destination) -> None:
        self.inner = inner

    def commit(self) -> None:
        self.inner.commit()

    def prepare(self, *, overwrites: bool = False) -> None:
        self.inner.prepare(overwrites=overwrites)

    def discard(self) -> None:
        self.inner.discard()

    def staged(self) -> Staged | None:
        return self.inner.staged()

    def rebind(self, params: Mapping[str, torch.Tensor]) -> bool:
        return self.inner.rebind(params)


class Params(Destination):
    """The engine's live parameters, written in place (``commit`` has nothing left to do)."""

    name = "params"

    def __init__(self, params: Mapping[str, torch.Tensor]) -> None:
        self._params = dict(params)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._params

    def commit(self) -> None:
        return None

    def rebind(self, params: Mapping[str, torch.Tensor]) -> bool:
        held = self._params
        if all(n in held and held[n].data_ptr() == t.data_ptr() for n, t in params.items()):
            return False
        self._params = dict(params)  # a new mapping: views made of the old one are made again
        return True


@dataclass(frozen=True)
class Slice:
    """A box of a HuggingFace checkpoint tensor: ``tensor`` is ``name[offsets : offsets+shape]``
    of a tensor whose full shape is ``full_shape``."""

    name: str
    offsets: tuple[int, ...]
    full_shape: tuple[int, ...]
    tensor: torch.Tensor


class Loader(Destination):
    """For engines whose parameters cannot be written directly (repacked, quantized): the
    receive lands in engine-layout staging tensors, and ``commit`` hands ``load`` every
    checkpoint-format slice this rank holds, tensor by tensor.

    Memory: one copy of this rank's shard (the staging tensors, kept across updates so a
    delta applies to the last values).
    """

    name = "loader"

    def __init__(self, rank: RankLayout, logical: Mapping[str, tuple[int, ...]],
                 load: Callable[[Iterator[Slice]], None], *, dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.rank, self.logical, self.load = rank, dict(logical), load
        self._staging = {t.name: torch.zeros(t.shape, dtype=dtype, device=device) for t in rank.tensors}

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return self._staging

    def slices(self) -> Iterator[Slice]:
        for p in self.rank.pieces:
            yield Slice(p.logical, tuple(p.offsets), tuple(self.logical[p.logical]),
                        self._staging[p.local][region(tuple(p.local_offsets), tuple(p.sizes))])

    def commit(self) -> None:
        self.load(self.slices())


@dataclass(frozen=True)
class StagingFacts:
    """What an update's record says of the staging it went through."""

    mode: Commit  # how a commit makes the staged copy served
    nbytes: int  # bytes staged (the window)
    shard_bytes: int  # bytes of the rank's whole shard


class Staged(Destination):
    """Receive while serving: the paths write into a second copy of this rank's tensors and
    ``commit`` (between two forward steps) makes it the served one - by swapping storages
    (pointer moves: for engines that re-read ``param.data`` every step) or, where the
    engine captured its pointers (CUDA graphs), one device copy per tensor.

    ``budget`` bytes below the rank's shard stage a window: the tensors a receive writes
    first (``plan_window``, from the compiled order) up to the budget; the rest are written
    in place after ``gate`` paused the engine (``runtime.gated``).  A cut or failed receive
    leaves the served weights untouched unless it had passed the gate (``touched``).  After a
    swap, or a failed receive, staging lags the served weights; ``prepare`` (run off the
    pause, before the next receive) catches it up, so a delta applies to what is served.
    A pushing trainer (``transport.colocated.push_sender``) writes ``sets()`` from its own process: the
    commit then orders the served stream after its writes (``ready_at``) and records
    ``fence()`` for the trainer's next writes.
    Memory: the staged tensors (``nbytes``; one copy of the shard without a budget).
    """

    name = "staged"

    def staged(self) -> Staged:
        return self

    def __init__(self, params: Mapping[str, torch.Tensor], *, commit: str | Commit = Commit.SWAP,
                 budget: int | None = None) -> None:
        commit = Commit.parse(commit, "commit")
        if budget is not None and budget <= 0:
            raise ValueError(f"a staging budget must be positive (got {budget}); use Params to receive in place")
        self.mode, self.budget = commit, budget
        self._live = dict(params)
        self.shard_bytes = sum(_nbytes(t) for t in self._live.values())
        self.gate: Callable[[], None] | None = None  # pauses the engine before the first in-place write
        self.touched = False  # this receive passed the gate (served weights written)
        self._fence: torch.cuda.Event | None = None  # interprocess: served-side reads of old storages done
        self._fenced = False  # recorded since the last prepare
        self._ready: list = []  # CUDA events another process's writes into staging end at
        self._served_ready: list = []  # ... of the set served now, not waited for yet (``settle``)
        self.window: tuple[str, ...] = ()
        self.plan_window(list(self._live))

    @property
    def whole(self) -> bool:
        return len(self.window) == len(self._live)

    def plan_window(self, order: list[str]) -> None:
        """Stage the first tensors of ``order`` (the receive's write order) that fit the budget;
        (re)allocates staging as copies of the served weights.  Call between receives."""
        names = [n for n in dict.fromkeys(order) if n in self._live]
        names += [n for n in self._live if n not in set(names)]
        if self.budget is not None and self.budget < self.shard_bytes:
            used, kept = 0, []
            for n in names:
                used += _nbytes(self._live[n])
                if used > self.budget:
                    break
                kept.append(n)
            names = kept
        if tuple(names) == self.window:
            return
        self.window = tuple(names)
        # two fixed mappings (A served, B staging, then the other way round): a path that
        # compiled views of one mapping finds them again two updates later
        self._sets: list[dict[str, torch.Tensor]] = [{n: self._live[n].detach().clone() for n in names}, {}]
        self._views: list[Mapping[str, torch.Tensor] | None] = [self._view(0), None]
        self._staging = 0
        self._behind = False
        self.nbytes = sum(_nbytes(t) for t in self._sets[0].values())

    def _view(self, i: int) -> Mapping[str, torch.Tensor]:
        if self.whole:
            return self._sets[i]
        return Gated(self._sets[i], self._live, self._pass_gate)

    def _pass_gate(self) -> None:
        if not self.touched:
            if self.gate is not None:
                self.gate()
            self.touched = True

    def tensors(self) -> Mapping[str, torch.Tensor]:
        view = self._views[self._staging]
        if view is None:
            view = self._views[self._staging] = self._view(self._staging)
        return view

    def served(self) -> Mapping[str, torch.Tensor]:
        return self._live

    def sets(self) -> list[dict[str, torch.Tensor]]:
        """Every mapping a receive may write, for a writer in another process to map once:
        with ``swap`` both (the second is the served storages until the first swap), with
        ``copy`` the one staging copy; ``staging_index`` says which the next receive writes."""
        if not self.whole:
            raise ValueError("a staging window is written partly in place, after the engine paused: only "
                             "whole staged shards can be written from another process (no staging budget)")
        if self.mode is Commit.COPY:
            return self._sets[:1]
        if not self._sets[1]:
            self._sets[1] = {n: self._live[n].data for n in self.window}
        return self._sets

    @property
    def staging_index(self) -> int:
        return self._staging

    def fence(self) -> torch.cuda.Event | None:
        """An interprocess event (CUDA shards) recorded after every commit on the committing
        stream: a writer of the next staging set waits on it, so it never writes storages a
        step queued before the commit still reads."""
        first = next(iter(self._live.values()), None)
        if first is None or not first.is_cuda:
            return None
        if self._fence is None:
            from shardsync.transport.events import new_event

            self._fence = new_event()
            self._fence.record(torch.cuda.current_stream(first.device))  # creates it on the shard's device
        return self._fence

    def ready_at(self, event: torch.cuda.Event) -> None:
        """This receive's writes into staging (another process's) end at ``event`` on the GPU:
        after ``commit`` swapped them in, ``settle`` (before anything reads the served weights)
        orders that read after the event; no CPU waits for the copies."""
        self._ready.append(event)

    def settle(self) -> None:
        """Before the served weights are read (a step, a checksum): wait, on the GPU, for writes
        of another process that a commit swapped in (``ready_at``) and are still running.
        Deferred to here, not done in the commit, so an idle engine queues no GPU work while
        the writer's copy runs: another context's work on the GPU costs the copy a time slice
        (~1.9 ms on the H200, docs/gpu.md)."""
        if self._served_ready:
            stream = torch.cuda.current_stream()
            for event in self._served_ready:
                if not event.query():
                    stream.wait_event(event)
            self._served_ready.clear()

    def prepare(self, *, overwrites: bool = False) -> None:
        """Before a receive: staging := served where it lags (bases of deltas, rows no plan
        writes).  ``overwrites``: the receive writes every element a plan writes and was
        written already (a push): nothing is caught up - a copy now would race its writes,
        and what no plan writes is the same in both sets (both began as the served weights)."""
        self.touched = False
        if overwrites:  # nothing is written here: the writer waits on the fence itself
            self._behind = False
        elif self._fenced:
            assert self._fence is not None, "fenced only after fence() made the event"
            torch.cuda.current_stream().wait_event(self._fence)
        self._fenced = False
        if self._behind:
            staging = self._sets[self._staging]
            names = list(staging)
            if names:
                torch._foreach_copy_([staging[n] for n in names], [self._live[n].detach() for n in names])
            self._behind = False

    def discard(self) -> None:
        """A receive into staging failed: the staged window is dropped (the served weights
        stand unless ``touched``); staging is caught up later."""
        self._behind = True
        self._ready.clear()

    @property
    def facts(self) -> StagingFacts:
        return StagingFacts(self.mode, self.nbytes, self.shard_bytes)

    def commit(self) -> None:
        ready, self._ready = self._ready, []
        staging = self._sets[self._staging]
        names = list(staging)
        if self.mode is Commit.COPY:
            self.settle()
            for event in ready:  # the copy below reads another process's writes
                torch.cuda.current_stream().wait_event(event)
            if names:
                torch._foreach_copy_([self._live[n].data for n in names], [staging[n] for n in names])
        else:
            old = self._staging ^ 1
            if not self._sets[old]:  # first swap: the engine's own storages become set B
                self._sets[old] = {n: self._live[n].data for n in names}
            for n in names:
                self._live[n].data = staging[n]
            self._staging, self._behind = old, True
            self._served_ready = ready  # what the served weights now wait for (``settle``)
        fence = self.fence()
        if fence is not None and (self.mode is Commit.COPY or not torch.cuda.current_stream().query()):
            fence.record()  # after the steps still queued on the old storages
            self._fenced = True


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
