"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5) for both reference models: the
lightning indexer scores every key for every query from its own small projections, and each
query attends only to its ``index_topk`` best keys (with the causal mask, as transformers
does).  The indexer is replicated on every TP rank of both sides, so every rank chooses the
same keys; it takes no gradient (transformers runs it under ``no_grad``; its training loss is
not the RL loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardsync.family.section import Indexer, Latent
from shardsync.spec import ModelSpec

INDEX_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers, SGLang and megatron-core alike)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def index_rope(spec: ModelSpec, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first ``qk_rope_head_dim`` channels of ``x`` [b, s, (heads,) d].  ``cos``/``sin``
    are the model's [b, s, rope] in its own pair layout; the indexer turns neighbouring pairs
    (GLM-5) or halves (DeepSeek-V3.2) whatever the main attention does."""
    r = spec.section(Latent).qk_rope_head_dim
    angles_cos, angles_sin = (t[..., 0::2] if spec.rope_interleaved else t[..., : r // 2] for t in (cos, sin))
    if spec.family_table.index_rope_interleaved:
        c, s_ = angles_cos.repeat_interleave(2, dim=-1), angles_sin.repeat_interleave(2, dim=-1)
        rotate = _rotate_pairs
    else:
        c, s_ = torch.cat((angles_cos, angles_cos), dim=-1), torch.cat((angles_sin, angles_sin), dim=-1)
        rotate = _rotate_half
    if x.dim() == 4:
        c, s_ = c[:, :, None], s_[:, :, None]
    head, rest = x[..., :r], x[..., r:]
    return torch.cat((head * c + rotate(head) * s_, rest), dim=-1)


@torch.no_grad()
def index_keys(spec: ModelSpec, x: torch.Tensor, wk: torch.Tensor, norm_weight: torch.Tensor,
               norm_bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer's key of every position ``[b, s, index_head_dim]`` (what a KV cache keeps)."""
    k = F.layer_norm(F.linear(x, wk), (spec.section(Indexer).index_head_dim,), norm_weight, norm_bias, INDEX_NORM_EPS)
    return index_rope(spec, k, cos, sin)


@torch.no_grad()
def select(spec: ModelSpec, x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, wq_b: torch.Tensor,
           weights_proj: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Which keys each query attends to: a boolean ``[b, s, t]`` (True: attend).  ``x`` the layer's
    normed input [b, s, H], ``q_latent`` the query's normed low-rank latent [b, s, q_lora],
    ``keys`` every key so far [b, t, d] (``index_keys``), ``start`` the first query's position.

    Score of key t for query s: sum over heads h of w[s, h] / sqrt(heads) * relu(q[s, h] . k[t] /
    sqrt(d)), in float32; the causal mask applies before the top-k, as in transformers."""
    b, s = x.shape[:2]
    t = keys.shape[1]
    ix = spec.section(Indexer)
    n, d = ix.index_n_heads, ix.index_head_dim
    q = index_rope(spec, F.linear(q_latent, wq_b).view(b, s, n, d), cos, sin)
    scores = F.relu(torch.einsum("bshd,btd->bsht", q.float(), keys.float()) * d ** -0.5)
    w = F.linear(x.float(), weights_proj.float()) * n ** -0.5  # float32, as transformers keeps weights_proj
    index = torch.einsum("bsh,bsht->bst", w, scores)
    rows = torch.arange(s, device=x.device)[:, None] + start
    future = torch.arange(t, device=x.device)[None, :] > rows
    index = index.masked_fill(future, float("-inf"))
    chosen = index.topk(min(ix.index_topk, t), dim=-1).indices
    return torch.zeros(b, s, t, dtype=torch.bool, device=x.device).scatter_(-1, chosen, True)
