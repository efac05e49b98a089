"""shardsync's vocabulary: every closed set of names a config, the wire, the engine and the
records share, one ``Word`` enum each.

A word is a ``str`` (it compares equal to its text, JSON and pydantic carry it as that text)
so configs take plain strings and turn them into words once, at construction
(``Word.parse``); past that edge nobody re-parses or re-spells them.  ``Mode`` (``mode.py``)
is the path of an update, the first word of this kind.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

W = TypeVar("W", bound="Word")


class Word(str, Enum):
    """A closed set of names; the value is the spelling users, the wire and records see."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls: type[W], value: str | W, what: str) -> W:
        """``value`` as a word of this set, or ValueError naming ``what`` and every choice."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be one of {cls.names()}, got {value!r}") from None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(w.value for w in cls)


class Request(Word):
    """What ``SyncConfig.mode`` asks of a connection's full updates."""

    AUTO = "auto"  # p2p where its preconditions hold, else broadcast
    P2P = "p2p"  # p2p or refuse the connect
    BROADCAST = "broadcast"


class DeltaTransport(Word):
    """How changed elements travel (``DeltaConfig.transport``)."""

    P2P = "p2p"
    BROADCAST = "broadcast"
    DISK = "disk"


class Ipc(Word):
    """How a colocated engine reads the trainer's memory (``ColocatedConfig.ipc``)."""

    MAP = "map"  # the engine copies out of the trainer's mapped tensors
    SLOTS = "slots"  # buckets through shared slots
    PUSH = "push"  # the trainer writes the engine's staging copy


class Completion(Word):
    """When a colocated map update returns (``ColocatedConfig.complete``)."""

    STREAM = "stream"  # once the engines' copies are queued (events order the rest)
    HOST = "host"  # once the copies ran


class Signals(Word):
    """How a colocated map update's signals travel (``ColocatedConfig.signals``)."""

    MAILBOX = "mailbox"  # records in shared host memory
    GROUP = "group"  # messages through the sync group


class Channel(Word):
    """Where an update's begin and finish reach the engines (``ControlConfig.channel``)."""

    STORE = "store"  # keys in the sync group's store (reference engines)
    HTTP = "http"  # two POSTs per engine (reference engines)
    VLLM = "vllm"  # vLLM's own endpoints
    SGLANG = "sglang"  # SGLang's own endpoints


class Crossing(Word):
    """What a weight change does to requests running when it lands."""

    FINISH = "finish"  # they finish on the old version (the change waits, bounded)
    SPAN = "span"  # they continue on the new one (re-prefilled; spans in the response)
    ABORT = "abort"  # they end with a retryable error


class Commit(Word):
    """How a staged receive becomes the served weights."""

    SWAP = "swap"  # storages swapped (engines that re-read ``param.data``)
    COPY = "copy"  # one device copy per tensor (engines that captured pointers)


class Staging(Word):
    """Where an update's bytes landed while the engine served (an update's record)."""

    IN_PLACE = "in-place"
    SWAP = "swap"
    COPY = "copy"


class Reason(Word):
    """Why an engine refused or failed a call: the kind a caller acts on, beside the text."""

    LAYOUT_MISMATCH = "layout-mismatch"  # its parameters are not shardsync's engine layout
    UPDATE_FAILED = "update-failed"  # a rank's receive failed
    SESSION_OPEN = "session-open"  # an update session was already open


class Refused(RuntimeError):
    """An engine refused a call before touching its weights; the connection stays usable.
    ``reason`` is the kind a caller acts on (None: only the text says why); ``variants``: for
    a layout refusal, engine index -> the layout variants its parameters are."""

    def __init__(self, message: str, reason: Reason | None = None,
                 variants: dict[int, list[str]] | None = None) -> None:
        super().__init__(message)
        self.reason, self.variants = reason, variants


class Phase(Word):
    """Where the reference engine's pending update stands (its scheduler's ``Pending.phase``)."""

    STAGING = "staging"  # receiving into staging while steps go on
    GATE = "gate"  # waiting on the crossing policy before the weights change
    OPEN = "open"  # paused: a staging window's rest lands in place, no step runs


class Op(Word):
    """A command the reference engine's dispatcher runs on every TP worker (in-host queues)."""

    GENERATE = "generate"  # a generation request (the dispatcher admits it, then steps it)
    ADMIT = "admit"  # start a request's sequences
    STEP = "step"  # decode the running sequences by a few tokens
    SCORE = "score"  # logprobs of given sequences
    CHECKSUM = "checksum"  # checksums of the served weights
    JOIN = "join"  # join the sync group a trainer opened
    DISCONNECT = "disconnect"  # leave the sync group
    UPDATE = "update"  # receive an update from the trainer
    PULL = "pull"  # apply a disk delta from a shared directory
    REFUSE = "refuse"  # answer a refused update the trainer already signalled
    STAGE = "stage"  # start an update or pull into staging on a thread; serving goes on
    OPEN = "open"  # the engine paused: a staging window's receive may write served weights
    COMMIT = "commit"  # make the staged receive the served weights
    STAGED = "staged"  # the dispatcher's own: a staged receive reported (never sent to a worker)
