"""How the GRPO loop talks to an engine's serving API: sample rollouts (tokens, logprobs,
the weight version that produced them) and score sequences, per engine kind.

``reference``: shardsync's engine (``/generate``, ``/logprobs``); ``vllm``: vLLM's OpenAI
``/v1/completions`` with token-id prompts (``return_tokens_as_token_ids``, ``echo`` for
scoring) and ``/weight_info`` for the version.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import httpx
import torch

from shardsync.control.hosted import weight_version


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    logprobs: list[float]


class Serving(Protocol):
    """What the demo's GRPO loop asks of a rollout engine (the reference one or vLLM)."""

    def generate(self, url: str, prompts: list[list[int]], *, max_new_tokens: int, temperature: float,
                 seed: int, timeout_s: float) -> tuple[list[Sample], int]:
        """Samples for ``prompts`` and the weight version the engine answered with."""
        ...

    def score(self, url: str, seqs: list[list[int]], *, timeout_s: float) -> torch.Tensor:
        """Logprob of every token after the first, ``[len(seqs), len - 1]``."""
        ...


def _post(url: str, body: dict, timeout_s: float) -> dict:
    r = httpx.post(url, json=body, timeout=timeout_s)
    if r.status_code >= 400:
        raise RuntimeError(f"POST {url} -> {r.status_code}: {r.text[:500]}")
    return r.json()


class ReferenceServing:
    def generate(self, url, prompts, *, max_new_tokens, temperature, seed, timeout_s):
        body = _post(url + "/generate", {"prompts": prompts, "max_new_tokens": max_new_tokens,
                                         "temperature": temperature, "seed": seed}, timeout_s)
        return [Sample(o["tokens"], o["logprobs"]) for o in body["outputs"]], body["weight_version"]

    def score(self, url, seqs, *, timeout_s):
        return torch.tensor(_post(url + "/logprobs", {"sequences": seqs}, timeout_s)["logprobs"])


class VllmServing:
    def __init__(self) -> None:
        self._models: dict[str, str] = {}

    def _model(self, url: str, timeout_s: float) -> str:
        if url not in self._models:
            r = httpx.get(url + "/v1/models", timeout=timeout_s)
            r.raise_for_status()
            self._models[url] = r.json()["data"][0]["id"]
        return self._models[url]

    def _version(self, url: str, timeout_s: float) -> int:
        r = httpx.get(url + "/weight_info", timeout=timeout_s)
        r.raise_for_status()
        return weight_version(r.json()["weight_version"])

    def _complete(self, url: str, timeout_s: float, **body) -> list[dict]:
        out = _post(url + "/v1/completions", {"model": self._model(url, timeout_s), "return_tokens_as_token_ids": True,
                                              "ignore_eos": True, **body}, timeout_s)
        return sorted(out["choices"], key=lambda c: c["index"])

    def generate(self, url, prompts, *, max_new_tokens, temperature, seed, timeout_s):
        version = self._version(url, timeout_s)  # generation never runs across an update: vLLM is paused
        # a seed is per request and repeats a prompt's sample: each run of equal prompts is one
        # request for n samples
        runs: list[tuple[list[int], int]] = []
        for p in prompts:
            if runs and runs[-1][0] == p:
                runs[-1] = (p, runs[-1][1] + 1)
            else:
                runs.append((p, 1))
        samples = []
        for i, (prompt, n) in enumerate(runs):
            for c in self._complete(url, timeout_s, prompt=prompt, n=n, max_tokens=max_new_tokens,
                                    temperature=temperature, seed=seed + i, logprobs=1):
                samples.append(Sample([int(t.removeprefix("token_id:")) for t in c["logprobs"]["tokens"]],
                                      [float(x) for x in c["logprobs"]["token_logprobs"]]))
        return samples, version

    def score(self, url, seqs, *, timeout_s):
        choices = self._complete(url, timeout_s, prompt=seqs, max_tokens=1, temperature=0, echo=True, logprobs=0)
        return torch.tensor([[float(x) for x in c["logprobs"]["token_logprobs"][1:len(s)]]
                             for c, s in zip(choices, seqs, strict=True)])


SERVING: dict[str, type] = {"reference": ReferenceServing, "vllm": VllmServing}


@functools.cache
def serving(kind: str) -> Serving:
    """The process's client for engines of ``kind`` (a key of ``SERVING``)."""
    return SERVING[kind]()
