"""``SyncConfig``: the trainer's settings for a sync, nested by concern.

Engine facts (kind, pipeline parallelism, quantization, dtype, TP) are not settings: the
trainer reads them from each engine at connect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("auto", "p2p", "broadcast")
DELTA_TRANSPORTS = ("p2p", "broadcast", "disk")
IPC_KINDS = ("map", "slots", "push")
COMPLETIONS = ("stream", "host")  # when a colocated map update returns (ColocatedConfig.complete)
SIGNALS = ("mailbox", "group")  # how a colocated map update's signals travel (ColocatedConfig.signals)
CHANNELS = ("store", "http", "vllm", "sglang")
CROSSINGS = ("finish", "span", "abort")  # what a weight change does to running requests


@dataclass(frozen=True, kw_only=True)
class TransportConfig:
    """The sync group: where trainer rank 0 hosts its rendezvous, how buffers are cut."""

    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port picked at connect
    timeout_s: float = 60.0  # every collective and receive
    bucket_mb: float = 64.0
    credits: int = 2  # buffers in flight per rank
    # every message through the sync group is followed by a digest the receiver checks before
    # unpacking: a corrupted bucket fails the update instead of landing silently
    verify_buckets: bool = False

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


@dataclass(frozen=True, kw_only=True)
class DeltaConfig:
    """Send only changed elements when every engine holds the version synced last."""

    transport: str = "p2p"  # p2p | broadcast | disk
    dir: str | None = None  # disk: a directory every engine can read
    pin_memory: bool = False  # the snapshot of the last synced values

    def __post_init__(self) -> None:
        if self.transport not in DELTA_TRANSPORTS:
            raise ValueError(f"delta transport must be one of {DELTA_TRANSPORTS}, got {self.transport!r}")
        if self.transport == "disk" and not self.dir:
            raise ValueError("delta over disk needs dir (a directory every engine can read)")


@dataclass(frozen=True, kw_only=True)
class ColocatedConfig:
    """Engines on the trainer's machine: ``map`` reads the trainer's tensors in place (CUDA
    IPC or CPU shared memory); ``slots`` stages buckets through exported buffers (device or shared memory);
    ``push``: the trainer writes each engine's staging copy itself (engines that stage whole
    shards), so the copies start with ``update()`` and the engine only checks and commits."""

    ipc: str = "map"
    # map between GPUs: "stream" returns once the engines' copies are queued, the trainer's
    # current stream waiting for them (its later writes there come after the reads); "host"
    # returns once they finished (for a trainer that writes its weights from other streams)
    complete: str = "stream"
    # map: "mailbox" offers each engine rank a shared-memory mailbox for the per-update signals
    # (an engine that cannot map it signals over the sync group instead); "group": never offer
    signals: str = "mailbox"

    def __post_init__(self) -> None:
        if self.ipc not in IPC_KINDS:
            raise ValueError(f"ipc must be one of {IPC_KINDS}, got {self.ipc!r}")
        if self.complete not in COMPLETIONS:
            raise ValueError(f"complete must be one of {COMPLETIONS}, got {self.complete!r}")
        if self.signals not in SIGNALS:
            raise ValueError(f"signals must be one of {SIGNALS}, got {self.signals!r}")
        if self.ipc == "push" and self.signals != "mailbox":
            raise ValueError("ipc='push' learns which staging copy to write from the engine's mailbox: "
                             "keep signals='mailbox'")


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Where each update's begin/finish go: ``store`` (keys in the sync group's store, ~0.2 ms)
    or ``http`` (two POSTs per engine, ~1.5 ms each).  Connect and verify use HTTP.
    ``vllm`` / ``sglang``: the engines are vLLM / SGLang servers, driven through their own
    endpoints (``control.vllm``, ``control.sglang``)."""

    channel: str = "store"
    http_timeout_s: float = 60.0
    # the secret shared with the engines (bearer token on state-changing calls, signature on
    # store values); None: $SHARDSYNC_TOKEN, else the file named by $SHARDSYNC_TOKEN_FILE
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    # requests running when an engine's weights change: finish (on the old version) | span |
    # abort; None: each engine's own no-mixing default (docs/serving.md has what each allows)
    crossing: str | None = None

    def __post_init__(self) -> None:
        if self.channel not in CHANNELS:
            raise ValueError(f"control channel must be one of {CHANNELS}, got {self.channel!r}")
        if self.crossing not in (None, *CROSSINGS):
            raise ValueError(f"crossing must be one of {CROSSINGS} or None, got {self.crossing!r}")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    mode: str = "auto"  # full updates: auto (p2p when its preconditions hold) | p2p | broadcast
    delta: DeltaConfig | None = None
    colocated: ColocatedConfig | None = None
    relay: bool = False  # engine i forwards to engine i+1 (p2p): the trainer sends one copy
    transport: TransportConfig = field(default_factory=TransportConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    records_path: str | None = None  # JSON lines, one record per update (rank 0)
    detail: bool = False  # per-bucket timings in records

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.colocated and self.mode == "broadcast":
            raise ValueError("colocated IPC moves full p2p updates between processes on one machine; "
                             "use mode='p2p' or 'auto'")
        if self.colocated and self.delta is not None:
            raise ValueError("colocated IPC reads whole tensors in place; a delta saves nothing there: "
                             "drop delta or colocated")
        if self.colocated and self.relay:
            raise ValueError("colocated IPC lets every engine read the trainer directly; relay is for "
                             "network links: drop one of them")
        if self.relay and self.delta is not None and self.delta.transport == "p2p":
            raise ValueError("relay applies to full p2p updates; delta over p2p sends every engine its "
                             "parts directly: use DeltaConfig(transport='broadcast') or relay=False")

    @property
    def ipc(self) -> str | None:
        return self.colocated.ipc if self.colocated else None
