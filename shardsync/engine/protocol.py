"""Serving messages of the reference engine's HTTP API (pydantic).  Sync messages live in
``control/wire.py``; status codes in ``server.py``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

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
