"""Serving messages of the reference engine's HTTP API (pydantic).  Sync messages live in
``control/wire.py``; status codes in ``server.py``."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_PROMPTS = 64
MAX_TOKENS = 4096  # per sequence
MAX_NEW_TOKENS = 1024
MAX_BATCH_TOKENS = 32768  # positions of one request (prompts x (prompt + new)): bounds its memory
MIN_TEMPERATURE = 1e-3  # below it logits / temperature overflows; 0 means greedy
MIN_TOP_P = 1e-4

Token = Annotated[int, Field(ge=0, lt=2**31)]
Tokens = Annotated[list[Token], Field(min_length=1, max_length=MAX_TOKENS)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class GenerateRequest(_Msg):
    prompts: list[Tokens] = Field(min_length=1, max_length=MAX_PROMPTS)
    max_new_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, ge=MIN_TOP_P, le=1.0)
    seed: int = Field(0, ge=0, lt=2**63)
    stop_token_ids: list[Token] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _bounded(self) -> GenerateRequest:
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        positions = sum(len(p) + self.max_new_tokens for p in self.prompts)
        if positions > MAX_BATCH_TOKENS:
            raise ValueError(f"prompts and max_new_tokens make {positions} positions; at most "
                             f"{MAX_BATCH_TOKENS} per request")
        return self


class Span(BaseModel):
    """Tokens ``first..last`` (indices into ``tokens``, inclusive) came from weight ``version``."""

    version: int
    first: int
    last: int


class Generation(BaseModel):
    tokens: list[int]
    logprobs: list[float]
    spans: list[Span] = Field(default_factory=list)  # more than one: the sequence crossed an update


class GenerateResponse(BaseModel):
    outputs: list[Generation]
    weight_version: int  # the newest version any token came from


class LogprobsRequest(_Msg):
    sequences: list[Tokens] = Field(min_length=1, max_length=MAX_PROMPTS)

    @model_validator(mode="after")
    def _bounded(self) -> LogprobsRequest:
        positions = sum(len(s) for s in self.sequences)
        if positions > MAX_BATCH_TOKENS:
            raise ValueError(f"sequences hold {positions} tokens; at most {MAX_BATCH_TOKENS} per request")
        return self


class LogprobsResponse(BaseModel):
    logprobs: list[list[float]]
    weight_version: int
