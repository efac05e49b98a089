"""The sync wire schema: every message between a trainer and an engine, and every key in
the sync group's store, as versioned pydantic models (JSON on the wire, never a pickle).

An engine's answer to an update (``UpdateResult``, from its ranks' ``RankReport``) is the
runtime's ledger (``runtime/ledger.py``); it rides in these messages as it is.

Status codes are not here: the HTTP edge (``engine/server.py``) maps ``control.session``
errors to them.  The reference engine's serving messages live in ``engine/protocol.py``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainSerializer, PlainValidator

from shardsync.lora import Lora
from shardsync.mode import Mode
from shardsync.runtime.ledger import UpdateResult
from shardsync.vocab import Channel, Crossing, DeltaTransport, Ipc, Reason

PROTOCOL_VERSION = 2
MAX_ENGINES = 64
MAX_VERSION = 2**53  # exact in every JSON reader
MAX_TIMEOUT_S = 600.0  # what a trainer may ask an engine to wait for a rendezvous

Version = Annotated[int, Field(ge=0, le=MAX_VERSION)]


class Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# -- HTTP bodies --

class LoraMsg(Msg):
    """The adapter a sync moves (``lora.Lora``): the engine must serve the same one."""

    rank: int = Field(ge=1, le=65536)
    alpha: float = Field(gt=0, le=1e6)
    targets: list[Annotated[str, Field(max_length=32)]] = Field(min_length=1, max_length=16)


def _to_lora(value: object) -> Lora:
    """A ``Lora`` (or its JSON) within ``LoraMsg``'s bounds, as a ``Lora``."""
    m = LoraMsg.model_validate(value, from_attributes=True)
    return Lora(m.rank, m.alpha, tuple(m.targets))


# An adapter field: a ``lora.Lora`` in code, ``LoraMsg``'s bounded JSON on the wire
LoraField = Annotated[Lora, PlainValidator(_to_lora), PlainSerializer(Lora.to_dict)]


class TrainerParallelMsg(Msg):
    kind: Literal["megatron", "fsdp2"] = "megatron"
    shard: int = Field(1, ge=1, le=65536)  # fsdp2: the shard group, and its copies (HSDP)
    replicate: int = Field(1, ge=1, le=65536)
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    dp: int = Field(1, ge=1, le=65536)
    pp_layers: list[Annotated[int, Field(ge=0, le=100000)]] | None = Field(None, max_length=1024)
    make_vocab_size_divisible_by: int = Field(128, ge=1, le=1 << 20)
    norm_names: str = "fused"
    dtype: str | None = None
    ep: int = Field(1, ge=1, le=65536)
    etp: int | None = Field(None, ge=1, le=1024)
    expert_names: Literal["sequential", "grouped"] = "sequential"


class RendezvousMsg(Msg):
    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2, le=65536)
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(60.0, gt=0, le=MAX_TIMEOUT_S)


# an engine's layout variant words (``layout.engine.ENGINE_VARIANTS``), bounded here, checked there
Variants = Annotated[list[Annotated[str, Field(max_length=32, pattern=r"^[a-z0-9_]+$")]], Field(max_length=8)]


class ConnectRequest(Msg):
    """Plan exchange: the engine rebuilds the topology and must find the same fingerprints."""

    protocol: int = PROTOCOL_VERSION
    spec: dict = Field(max_length=64)
    trainer: TrainerParallelMsg
    engines: list[Annotated[int, Field(ge=1, le=1024)]] = Field(min_length=1, max_length=MAX_ENGINES)
    engine_index: int = Field(ge=0, lt=MAX_ENGINES)
    whole: list[bool] = Field(default_factory=list, max_length=MAX_ENGINES)  # per engine; [] = none
    # per engine; [] = 1
    engine_ep: list[Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=list, max_length=MAX_ENGINES)
    # per engine; [] = 1
    engine_pp: list[Annotated[int, Field(ge=1, le=1024)]] = Field(default_factory=list, max_length=MAX_ENGINES)
    engine_variants: list[Variants] = Field(default_factory=list, max_length=MAX_ENGINES)  # per engine; [] = none
    fingerprints: dict[str, Annotated[str, Field(max_length=64)]] = Field(max_length=4)
    bucket_bytes: int = Field(ge=1024, le=2**34)
    credits: int = Field(2, ge=1, le=64)
    relay: bool = False
    ipc: Ipc | None = None  # colocated: how the engine reads the trainer's memory
    verify: bool = False  # every sync-group message followed by its digest (both sides must agree)
    delta: DeltaTransport | None = None  # the trainer's delta path (paths.connection_modes on both ends)
    control: Channel = Channel.STORE  # where begin/finish arrive (hosted engines: their own endpoints)
    rendezvous: RendezvousMsg
    lora: LoraField | None = None  # an adapter-only sync: every plan holds the adapter's tensors alone

    def ranks_of(self, engine: int) -> int:
        """Engine ``engine``'s ranks in the sync (TP x PP stages)."""
        return self.engines[engine] * (self.engine_pp[engine] if self.engine_pp else 1)


def _over_group(mode: Mode) -> Mode:
    if not mode.over_group:
        raise ValueError(f"{mode.value} does not move through the sync group; engines pull it")
    return mode


class BeginRequest(Msg):
    version: Version
    mode: Annotated[Mode, AfterValidator(_over_group)]  # a path whose bytes come through the group
    fingerprint: str = Field(max_length=64)
    base_version: Version | None = Field(None, description="delta modes: the version the delta is against")
    crossing: Crossing | None = None  # None: the engine's own policy
    # the trainer's transport signal follows without waiting for the answer: a refusal must
    # be answered through the transport too (``Refused``), so the trainer never waits it out
    pipelined: bool = False


class PullRequest(Msg):
    """Apply a delta version published on disk (every TP worker reads its own parts)."""

    root: str = Field(min_length=1, max_length=4096)
    version: Version


class FinishRequest(Msg):
    version: Version


class VersionResponse(BaseModel):
    weight_version: int
    stale: bool
    connected: bool


class InfoResponse(BaseModel):
    """What the engine is: the trainer plans from these facts (never from its own config)."""

    protocol: int = PROTOCOL_VERSION
    spec: dict
    tp: int
    ep: int = 1  # expert parallel within the TP group (MoE)
    dtype: str
    weight_version: int
    stale: bool
    kind: str = "reference"
    pp: int = 1
    quantization: str | None = None
    variants: Variants = Field(default_factory=list)  # how its layout departs from the default
    lora: LoraField | None = None  # the adapter it serves on its base (a sync moves that adapter alone)


class ChecksumResponse(BaseModel):
    weight_version: int
    stale: bool
    checksums: dict[str, str | None]


# -- store values (trainer ranks agreeing; trainer rank 0 <-> engine control threads) --

class EngineFacts(Msg):
    """What every engine of a connection serves, as their facts said (``InfoResponse``): how they
    host the receiver (``kind``, and ``pp``, the pipeline depth of engines whose layout has no
    stages), the quantization they serve and the adapter; the trainer composes its views from it."""

    kind: str = Field(default="reference", max_length=32)
    pp: int = Field(default=1, ge=1, le=1024)
    quantization: str | None = Field(default=None, max_length=64)
    lora: LoraField | None = None


class Decision(Msg):
    """Trainer rank 0's connect decision, shared with the other trainer ranks."""

    tps: list[int] = Field(default_factory=list)
    eps: list[int] = Field(default_factory=list)
    pps: list[int] = Field(default_factory=list)  # engines that host pipeline stages (SGLang); [] = 1
    variants: list[Variants] = Field(default_factory=list)  # each engine's layout variants; [] = none
    dtype: str = ""
    port: int = 0
    name: str = ""
    facts: EngineFacts = EngineFacts()
    error: str | None = None


class Go(Msg):
    """Trainer rank 0's decision for one update: the path, or why there is none."""

    mode: Mode | None = None
    error: str | None = None


class Done(Msg):
    """The engines' results of one update, or rank 0's error."""

    engines: list[UpdateResult] = Field(default_factory=list)
    error: str | None = None
    refused: bool = False  # the error is engines refusing (``Refused``): nothing broke


class Note(Msg):
    """One trainer rank's word for the others: an error (and its kind, where one acts on it) or nothing."""

    error: str | None = None
    reason: Reason | None = None
    variants: dict[int, Variants] | None = None  # a layout refusal: engine index -> the variants it holds


class Accepted(Msg):
    ok: bool = False
    error: str | None = None


class BoxSum(Msg):
    logical: str
    offsets: list[int]
    sizes: list[int]
    value: int


class RankSums(Msg):
    """One rank's checksums of its pieces (``runtime.checksum`` keys as fields)."""

    boxes: list[BoxSum]

    @classmethod
    def of(cls, sums: dict) -> RankSums:
        return cls(boxes=[BoxSum(logical=k[0], offsets=list(k[1]), sizes=list(k[2]), value=v)
                          for k, v in sums.items()])

    def keyed(self) -> dict:
        return {(b.logical, tuple(b.offsets), tuple(b.sizes)): b.value for b in self.boxes}


class Verdict(Msg):
    mismatched: list[str]


class Stop(Msg):
    stop: Literal[True] = True


class Joined(Msg):
    """An engine rank that joined: whether an update session of a previous trainer is open."""

    session_open: bool = False
