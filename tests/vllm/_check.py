"""What a vLLM engine must reproduce: ``transformers`` greedy tokens and logprobs on the
trainer's current weights (float32), and the weights every version of a test holds."""

from __future__ import annotations

import httpx
import torch

from shardsync.layout.logical import logical_tensors
from shardsync.models.weights import random_source, sparse_change
from shardsync.spec import ModelSpec

PROMPTS = ([1, 5, 9, 13, 77], [1, 400, 3, 3, 250, 8])
MAX_TOKENS = 8


def version_source(spec: ModelSpec, version: int, base: int | None = None):
    """Full weights of ``version`` (seed 100+version), or ``base``'s with about 1 % of the
    elements of every tensor changed (what a delta update carries)."""
    if base is None:
        return random_source(spec, seed=100 + version)
    return sparse_change(random_source(spec, seed=100 + base), version)


def hf_reference(spec: ModelSpec, source) -> list[tuple[list[int], list[float]]]:
    """Greedy continuation and the logprob of each chosen token, by ``transformers``."""
    import transformers

    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in spec.to_hf_config().items() if k != "architectures"})
    cfg.torch_dtype = torch.float32
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    state = {name: source(name) for name in logical_tensors(spec)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m == "lm_head.weight" for m in missing), (missing, unexpected)
    return _greedy(model)


def hf_checkpoint_reference(path: str) -> list[tuple[list[int], list[float]]]:
    """``hf_reference`` of a checkpoint directory, read by ``from_pretrained``: transformers'
    own key conversion (its MoE models fuse the per-expert tensors of the checkpoint)."""
    import transformers

    return _greedy(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


def _greedy(model) -> list[tuple[list[int], list[float]]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids, lps = list(prompt), []
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                tok = int(logits.argmax())
                lps.append(float(torch.log_softmax(logits, -1)[tok]))
                ids.append(tok)
            out.append((ids[len(prompt):], lps))
    return out


def vllm_generate(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True, "ignore_eos": True})
        r.raise_for_status()
        lp = r.json()["choices"][0]["logprobs"]
        out.append(([int(t.removeprefix("token_id:")) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]))
    return out


def compare(got, want, tol: float = 1e-5) -> str | None:
    """None when tokens are identical and logprobs agree within ``tol``, else what differs."""
    for i, ((gt, gl), (wt, wl)) in enumerate(zip(got, want, strict=True)):
        if gt != wt:
            return f"prompt {i}: vLLM tokens {gt}, transformers {wt}"
        worst = max(abs(a - b) for a, b in zip(gl, wl, strict=True))
        if worst > tol:
            return f"prompt {i}: logprobs differ by {worst:.2e} (> {tol})"
    return None
