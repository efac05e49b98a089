"""What the reference engine's scheduler (``engine.dispatch``) holds: how serving and updates
share the engine (``Serving``), a command for every worker, one prompt's generation with the
weight versions that produced it, and the update in progress; and the errors a request ends with."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from shardsync.mode import Mode
from shardsync.vocab import Crossing, Op, Phase


class BusyError(RuntimeError):
    """The request waited longer than its deadline (an update was in progress)."""


class Aborted(RuntimeError):
    """A request a weight update ended (crossing policy); retrying it runs on the new weights."""


SERVING = (Op.GENERATE, Op.SCORE)
# commands that write weights -> their mode (None: in the args)
UPDATES: dict[Op, Mode | None] = {Op.UPDATE: None, Op.PULL: Mode.DELTA_DISK}
# Weight commands go ahead of queued serving (an update is never starved by generation); a
# request overtaken by an update runs on the new weights and says so (its version).
PRIORITY = {Op.GENERATE: 1, Op.SCORE: 1, Op.CHECKSUM: 1}


@dataclass(frozen=True)
class Serving:
    """How generation and weight updates share the engine."""

    crossing: Crossing = Crossing.FINISH  # what a weight change does to running sequences
    commit_wait_s: float = 30.0  # finish: the longest a change waits for them, then they abort
    max_running: int = 256  # sequences decoded per step
    tokens_per_step: int = 1  # tokens each sequence gets per step (weights change between steps)

    def __post_init__(self) -> None:
        object.__setattr__(self, "crossing", Crossing.parse(self.crossing, "crossing"))
        if self.commit_wait_s < 0 or self.max_running < 1 or self.tokens_per_step < 1:
            raise ValueError("commit_wait_s must be >= 0, max_running and tokens_per_step >= 1")


@dataclass
class Command:
    kind: Op
    args: dict[str, Any]
    future: Future = field(default_factory=Future)
    started: Future = field(default_factory=Future)  # set when the workers begin running it
    deadline: float | None = None
    timeout_s: float = 300.0


@dataclass
class Seq:
    """One prompt's generation as the scheduler sees it; ``spans``: [version, first, last]
    token indices produced by each weight version."""

    sid: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[list[int]] = field(default_factory=list)
    done: bool = False

    def add(self, token: int, logprob: float, version: int) -> None:
        i = len(self.tokens)
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] = i
        else:
            self.spans.append([version, i, i])


@dataclass
class Request:
    cmd: Command
    seqs: list[Seq]


@dataclass
class Pending:
    """The update in progress: staged (receiving while steps go on), then gated (waiting on
    the crossing policy), then applied.  A staging window's receive asks for the gate
    mid-receive (``window``); the engine then pauses (``open``) while its rest lands in place."""

    cmd: Command
    staged: bool
    t0: float
    crossing: Crossing
    phase: Phase = Phase.GATE  # in place: at the gate at once; staged: STAGING first
    reports: dict[int, dict] = field(default_factory=dict)
    stage_s: float = 0.0
    gate_t0: float | None = None
    crossed: int = 0
    window: bool = False  # a worker waits at the gate: the receive is not over
    open_t0: float | None = None  # the engine paused for the in-place rest
    drain_s: float = 0.0
    touched: bool = False  # some worker wrote served weights (a failure leaves them torn)
