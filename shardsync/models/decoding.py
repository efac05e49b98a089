"""One sequence's decoding state on the reference engine: its KV cache (``KVCache``), its sampling
settings and tokens so far (``Decoding``).  How each next token is drawn: a seed per prompt
(``prompt_seed``), then greedy or nucleus sampling (``sample_token``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from shardsync.models.deltanet import DeltaState

Generation = tuple[list[int], list[float]]


@dataclass
class KVCache:
    """Per-layer keys/values ``[batch, local kv heads, capacity, head_dim]``, filled to ``length``
    (empty on linear-attention layers); sparse attention's indexer keys ``[batch, capacity,
    index_head_dim]`` per layer too; linear attention's carried state per layer (None before
    the first step and on other layers)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    index_keys: list[torch.Tensor] = field(default_factory=list)
    linear: list[DeltaState | None] = field(default_factory=list)
    length: int = 0
    capacity: int = field(init=False)

    def __post_init__(self) -> None:
        self.capacity = self.keys[0].shape[2] if self.keys else 0


@dataclass
class Decoding:
    """One sequence being generated: its sampling settings, tokens so far and KV cache.
    ``cache = None`` means the next step prefills prompt + tokens (a new sequence, or one
    whose cache was built on weights that have since changed)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: set[int]
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cache: KVCache | None = None
    done: bool = False


def prompt_seed(seed: int, index: int) -> int:
    digest = hashlib.sha256(f"generate:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_token(logits: torch.Tensor, temperature: float, top_p: float,
                 generator: torch.Generator | None) -> int:
    """One token from 1-D ``logits``: argmax when ``temperature == 0``, else nucleus sampling.

    Top-p keeps the smallest prefix of tokens (by descending probability, ties by index)
    whose mass reaches ``top_p``; the first token is always kept.
    """
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True, stable=True)
        keep = (sorted_p.cumsum(0) - sorted_p) < top_p
        choice = torch.multinomial(sorted_p * keep, 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
