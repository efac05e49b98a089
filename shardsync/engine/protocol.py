"""Wire messages of the engine HTTP API (pydantic, versioned).  Status codes live in server.py."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

PROTOCOL_VERSION = 1
MAX_PROMPTS = 64
MAX_TOKENS = 4096
MAX_NEW_TOKENS = 1024


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerateRequest(_Msg):
    prompts: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_new_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)


class Generation(BaseModel):
    tokens: list[int]
    logprobs: list[float]


class GenerateResponse(BaseModel):
    outputs: list[Generation]
    weight_version: int


class LogprobsRequest(_Msg):
    sequences: list[list[int]] = Field(min_length=1, max_length=MAX_PROMPTS)


class LogprobsResponse(BaseModel):
    logprobs: list[list[float]]
    weight_version: int


class TrainerParallelMsg(_Msg):
    tp: int = Field(ge=1)
    pp: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    pp_layers: list[int] | None = None
    make_vocab_size_divisible_by: int = Field(128, ge=1)
    norm_names: str = "fused"
    dtype: str | None = None


class RendezvousMsg(_Msg):
    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    name: str = Field(min_length=1, max_length=128)
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = Field(60.0, gt=0, le=3600)


class ConnectRequest(_Msg):
    """Plan exchange: the engine rebuilds the topology and must find the same fingerprints."""

    protocol: int = PROTOCOL_VERSION
    spec: dict
    trainer: TrainerParallelMsg
    engines: list[int] = Field(min_length=1)
    engine_index: int = Field(ge=0)
    fingerprints: dict[str, str]
    bucket_bytes: int = Field(ge=1024)
    credits: int = Field(2, ge=1, le=64)
    relay: bool = False
    ipc: bool | Literal["map", "slots"] = False
    control: Literal["http", "store"] = "http"  # where begin/finish arrive (engine/control.py)
    rendezvous: RendezvousMsg


class BeginRequest(_Msg):
    version: int = Field(ge=0)
    mode: Literal["p2p", "broadcast", "delta-p2p", "delta-broadcast"]
    fingerprint: str
    base_version: int | None = Field(None, ge=0, description="delta modes: the version the delta is against")


class PullRequest(_Msg):
    """Apply a delta version published on disk (every TP worker reads its own parts)."""

    root: str = Field(min_length=1, max_length=4096)
    version: int = Field(ge=0)


class FinishRequest(_Msg):
    version: int = Field(ge=0)


class UpdateResult(BaseModel):
    version: int
    mode: str
    ok: bool
    error: str | None = None
    pack_s: float = 0.0
    transfer_s: float = 0.0
    unpack_s: float = 0.0
    total_s: float = 0.0
    bytes_received: int = 0
    changed: int = 0
    buffer_bytes: int = 0
    buckets: int = 0


class VersionResponse(BaseModel):
    weight_version: int
    stale: bool
    connected: bool


class InfoResponse(BaseModel):
    protocol: int = PROTOCOL_VERSION
    spec: dict
    tp: int
    dtype: str
    weight_version: int
    stale: bool


def ctl_key(name: str, seq: int, what: str, engine: int | None = None) -> str:
    """Store key of the store control (``control="store"``): update ``seq`` of sync ``name``;
    ``what`` is begin (trainer rank 0 sets it), accepted or result (engine ``engine`` sets it)."""
    return f"{name}/ctl/{seq}/{what}" + ("" if engine is None else f"/{engine}")
