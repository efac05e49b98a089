"""``SyncConfig``: the trainer's settings for a sync, nested by concern.

Engine facts (kind, pipeline parallelism, quantization, dtype, TP) are not settings: the
trainer reads them from each engine at connect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardsync.lora import Lora
from shardsync.vocab import Channel, Completion, Crossing, DeltaTransport, Ipc, Request, Signals, Word

# Fields named in ``shardsync.vocab`` take their words or the words' text; ``__post_init__``
# turns the text into the word once (a bad value is refused there, naming every choice).


def _word(cfg: object, name: str, kind: type[Word], what: str) -> None:
    object.__setattr__(cfg, name, kind.parse(cfg.__dict__[name], what))


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

    transport: DeltaTransport = DeltaTransport.P2P
    dir: str | None = None  # disk: a directory every engine can read
    pin_memory: bool = False  # the snapshot of the last synced values

    def __post_init__(self) -> None:
        _word(self, "transport", DeltaTransport, "delta transport")
        if self.transport == "disk" and not self.dir:
            raise ValueError("delta over disk needs dir (a directory every engine can read)")


@dataclass(frozen=True, kw_only=True)
class ColocatedConfig:
    """Engines on the trainer's machine: ``map`` reads the trainer's tensors in place (CUDA
    IPC or CPU shared memory); ``slots`` stages buckets through exported buffers (device or shared memory);
    ``push``: the trainer writes each engine's staging copy itself (engines that stage whole
    shards), so the copies start with ``update()`` and the engine only checks and commits."""

    ipc: Ipc = Ipc.MAP
    # map between GPUs: "stream" returns once the engines' copies are queued, the trainer's
    # current stream waiting for them (its later writes there come after the reads); "host"
    # returns once they finished (for a trainer that writes its weights from other streams)
    complete: Completion = Completion.STREAM
    # map: "mailbox" offers each engine rank a shared-memory mailbox for the per-update signals
    # (an engine that cannot map it signals over the sync group instead); "group": never offer
    signals: Signals = Signals.MAILBOX

    def __post_init__(self) -> None:
        _word(self, "ipc", Ipc, "ipc")
        _word(self, "complete", Completion, "complete")
        _word(self, "signals", Signals, "signals")
        if self.ipc == "push" and self.signals != "mailbox":
            raise ValueError("ipc='push' learns which staging copy to write from the engine's mailbox: "
                             "keep signals='mailbox'")


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    """Where each update's begin/finish go: ``store`` (keys in the sync group's store, ~0.2 ms)
    or ``http`` (two POSTs per engine, ~1.5 ms each).  Connect and verify use HTTP.
    ``vllm`` / ``sglang``: the engines are vLLM / SGLang servers, driven through their own
    endpoints (``control.vllm``, ``control.sglang``)."""

    channel: Channel = Channel.STORE
    http_timeout_s: float = 60.0
    # the secret shared with the engines (bearer token on state-changing calls, signature on
    # store values); None: $SHARDSYNC_TOKEN, else the file named by $SHARDSYNC_TOKEN_FILE
    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    # requests running when an engine's weights change: finish (on the old version) | span |
    # abort; None: each engine's own no-mixing default (docs/serving.md has what each allows)
    crossing: Crossing | None = None

    def __post_init__(self) -> None:
        _word(self, "channel", Channel, "control channel")
        if self.crossing is not None:
            _word(self, "crossing", Crossing, "crossing")


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Every setting of one trainer's sync, nested by concern; engine facts are read at connect.
    Refuses combinations that cannot work, naming the fix."""

    mode: Request = Request.AUTO  # full updates: auto (p2p when its preconditions hold) | p2p | broadcast
    delta: DeltaConfig | None = None
    colocated: ColocatedConfig | None = None
    relay: bool = False  # engine i forwards to engine i+1 (p2p): the trainer sends one copy
    transport: TransportConfig = field(default_factory=TransportConfig)
    control: ControlConfig = field(default_factory=ControlConfig)
    # JSON lines, one record per update: rank 0's; with "{rank}" in it, every rank's own file
    records_path: str | None = None
    detail: bool = False  # per-bucket timings in records
    # a LoRA adapter: the sync moves it alone (``params`` are the trainer's adapter tensors) into
    # engines serving that adapter on their base
    lora: Lora | None = None

    def __post_init__(self) -> None:
        _word(self, "mode", Request, "mode")
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
    def ipc(self) -> Ipc | None:
        return self.colocated.ipc if self.colocated else None
