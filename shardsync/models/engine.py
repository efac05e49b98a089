"""The reference rollout engine: a tensor-parallel dense decoder holding the engine layout.

Parameters are exactly ``engine_layout(spec, EngineParallel(tp=tp_size)).ranks[tp_rank]``
(SGLang names and local shapes), so a sync runtime can write into them in place through
``named_parameters()`` / ``get_parameter``.  The math is ``shardsync.models.ops`` (written to
match ``transformers``); the TP scheme is SGLang's:

- vocab-parallel embedding: rank ``r`` looks up padded rows ``[r*P, (r+1)*P)``, other ids
  give zeros, then all-reduce;
- column-parallel ``qkv_proj`` / ``gate_up_proj`` (no communication);
- row-parallel ``o_proj`` / ``down_proj`` followed by an all-reduce;
- experts (sparse layers): the replicated router picks each token's top-k experts on every
  rank; a rank runs its own experts (EP block ``r // moe_tp``) on their MoE-TP slice and the
  partial outputs meet in the same all-reduce (SGLang's FusedMoE without a dispatcher);
- LM head: local logits, all-gather along the vocab, truncate to ``spec.vocab_size``.

Collective contract: every method that runs the model (``forward``, ``generate``,
``score``) is collective over the TP group.  All ranks call it in the same order with the
same arguments; each returns the same result on every rank.  With ``tp_size == 1`` and
``group=None`` nothing communicates.

Its layers are ``models.engine_layers``, a sequence's decoding state and sampling
``models.decoding``, the layer math ``models.ops``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsync.dtypes import torch_dtype
from shardsync.family.section import Indexer
from shardsync.layout import EngineParallel, Layout, engine_layout
from shardsync.lora import Lora, engine_adapter_layout
from shardsync.models.decoding import Decoding, Generation, KVCache, prompt_seed, sample_token
from shardsync.models.engine_layers import MLP, TP, Decoder, GqaAttention, Layer, Leaf
from shardsync.models.lora import LoraWeights, engine_terms
from shardsync.models.ops import rms_norm, rope_cos_sin
from shardsync.models.weights import TensorSource, load_rank
from shardsync.piece import addressed
from shardsync.quant import fp8_format, quantize, quantized
from shardsync.spec import DTYPES, ModelSpec

log = logging.getLogger(__name__)


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {DTYPES}")
    return name


class Hosting(Enum):
    """What a sync writes on a reference engine: its weights, its adapter's own tensors (a
    low-rank term beside the base), or its adapter merged into the base (no LoRA kernel)."""

    WEIGHTS = "weights"
    ADAPTER = "adapter"
    MERGED = "merged"


class EngineModel(nn.Module):
    """One TP rank of the reference engine (see the module docstring for the TP scheme).

    ``named_parameters()`` yields exactly the rank's engine-layout tensors, in layout order;
    they start zeroed (padding rows stay zero) and are filled by ``load_source`` or a sync.
    ``group`` is the TP process group (required when ``tp_size > 1``; its rank must equal
    ``tp_rank``).  Activations run in ``dtype``; logits are returned in float32.  ``ep``: expert
    parallel within the TP group (mixture-of-experts models).  ``quantization``: an FP8 format
    (``quant.FORMATS``): the linear weights ``quant.targets`` names are held in e4m3 with their
    scales (SGLang's names and shapes), multiplied by the FP8 GEMM where the GPU has it
    (``models.fp8_gemm``; ``fp8_gemm=False``: never) and dequantized elsewhere.  ``lora``: the engine serves
    that adapter on top of its base: ``adapter`` holds the rank's adapter tensors (zeroed, PEFT's
    names) and every adapted linear adds its low-rank term; a sync then writes the adapter
    (``synced_tensors``) and the base stays as loaded.  ``lora_merge``: no low-rank term; the
    engine serves base + ``scale * B @ A`` merged into its base shard (``receiver.merged``).
    """

    def __init__(self, spec: ModelSpec, tp_rank: int = 0, tp_size: int = 1,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = torch.float32,
                 device: str | torch.device = "cpu", *, ep: int = 1, quantization: str | None = None,
                 lora: Lora | None = None, lora_merge: bool = False, fp8_gemm: bool = True) -> None:
        super().__init__()
        if tp_size < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got tp_rank={tp_rank} tp_size={tp_size}")
        if tp_size > 1:
            if group is None:
                raise ValueError(f"tp_size={tp_size} needs the TP process group; pass group=")
            if dist.get_world_size(group) != tp_size or dist.get_rank(group) != tp_rank:
                raise ValueError(
                    f"group has size {dist.get_world_size(group)} and this process is its rank "
                    f"{dist.get_rank(group)}, but tp_size={tp_size} tp_rank={tp_rank}"
                )
        self.spec = spec
        self.device = torch.device(device)
        self.ep = ep
        self.layout: Layout = engine_layout(spec, EngineParallel(tp=tp_size, ep=ep, dtype=_dtype_name(dtype)))
        self.tp = TP(group, tp_rank, tp_size)
        rl = self.layout.ranks[tp_rank]
        self.model = Decoder(spec, rl, self.tp, ep, self.device)
        if not spec.tie_word_embeddings:
            self.lm_head = Leaf(rl, "lm_head", ("weight",), self.device)
        self.dtype = torch_dtype(_dtype_name(dtype))
        self.vocab_rows = rl.tensor("model.embed_tokens.weight").shape[0]
        got = [(n, tuple(p.shape)) for n, p in self.named_parameters()]
        assert got == [(t.name, t.stored) for t in rl.tensors], "parameters diverge from layout"
        self.quantization = None if quantization is None else fp8_format(quantization)
        self.targets = {} if self.quantization is None else quantized(rl, spec, self.quantization)
        for name, target in self.targets.items():
            assert self.quantization is not None  # targets only with a format
            leaf, attr = name.rsplit(".", 1)
            held = self.get_submodule(leaf)
            assert isinstance(held, Leaf), f"{name}: FP8 weights live on leaves"
            held.quantize_(attr, self.quantization, self.dtype, target.scale_shape, gemm=fp8_gemm)
        self.lora = lora
        self.hosting = Hosting.WEIGHTS if lora is None else Hosting.MERGED if lora_merge else Hosting.ADAPTER
        self.adapter: LoraWeights | None = None
        if lora is not None:
            par = EngineParallel(tp=tp_size, ep=ep, dtype=_dtype_name(dtype))
            self.adapter_layout = engine_adapter_layout(spec, lora, par)
        if lora is not None and self.hosting is Hosting.ADAPTER:
            self.adapter = LoraWeights(self.adapter_layout.ranks[tp_rank], self.device)
            for i, layer in enumerate(self.model.layers):
                terms = engine_terms(self.adapter, lora, i)
                cast(GqaAttention, layer.self_attn).lora = terms  # ``lora.check_lora``: GQA attention, dense MLPs
                if isinstance(layer.mlp, MLP):
                    layer.mlp.lora = terms

    def gemm_weights(self) -> list[str]:
        """The FP8 weights this rank multiplies by the FP8 GEMM (``models.fp8_gemm``), not dequantized."""
        return [f"{name}.{attr}" for name, leaf in self.named_modules() if isinstance(leaf, Leaf)
                for attr in sorted(leaf.gemm)]

    def synced_tensors(self) -> dict[str, torch.Tensor]:
        """What a sync writes, by layout name: the adapter's tensors when serving one, else every
        parameter of the model."""
        if self.adapter is not None:
            return self.adapter.tensors()
        return dict(self.named_parameters())

    @torch.no_grad()
    def load_adapter(self, source: TensorSource) -> None:
        """Overwrite the adapter in place with this rank's pieces of ``source`` (its PEFT tensors)."""
        assert self.adapter is not None, "load_adapter needs an engine built with lora="
        tensors = load_rank(self.adapter_layout, self.tp.rank, source, device=self.device)
        for name, t in self.adapter.tensors().items():
            t.copy_(tensors[name])

    @classmethod
    def from_source(cls, spec: ModelSpec, source: TensorSource, tp_rank: int = 0, tp_size: int = 1,
                    group: dist.ProcessGroup | None = None, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device = "cpu", *, ep: int = 1,
                    quantization: str | None = None, lora: Lora | None = None,
                    lora_merge: bool = False, fp8_gemm: bool = True) -> EngineModel:
        """Build rank ``tp_rank`` and fill it from ``source`` (``random_source``, ``checkpoint_source``);
        an adapter (``lora``) starts zeroed, as PEFT's ``B`` does: the base model's outputs."""
        model = cls(spec, tp_rank, tp_size, group, dtype, device, ep=ep, quantization=quantization, lora=lora,
                    lora_merge=lora_merge, fp8_gemm=fp8_gemm)
        model.load_source(source)
        return model

    @torch.no_grad()
    def load_source(self, source: TensorSource) -> None:
        """Overwrite every parameter in place with this rank's pieces of ``source`` (local, no comm);
        an FP8 engine quantizes its shard of each quantized weight."""
        tensors = load_rank(self.layout, self.tp.rank, source, device=self.device)
        rl = self.layout.ranks[self.tp.rank]
        params = dict(self.named_parameters())
        for t in rl.tensors:
            target = self.targets.get(t.name)
            if target is None:
                addressed(params[t.name], t).copy_(tensors[t.name])
                continue
            assert self.quantization is not None
            q, scale = quantize(tensors[t.name].view(target.shape), self.quantization)
            params[t.name].copy_(q)
            params[target.scale].copy_(scale)
        log.debug("tp%d: loaded %d tensors", self.tp.rank, len(tensors))

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty KV cache for ``batch`` sequences of up to ``capacity`` positions."""
        kv = [cast(Layer, layer).kv for layer in self.model.layers]
        n = self.spec.num_layers
        ix = self.spec.find(Indexer)  # sparse attention: each layer's indexer keys
        index = (batch, capacity, ix.index_head_dim if ix is not None else 0)
        return KVCache(
            keys=[torch.zeros(batch, h, capacity, k, dtype=self.dtype, device=self.device) for h, k, _ in kv],
            values=[torch.zeros(batch, h, capacity, v, dtype=self.dtype, device=self.device) for h, _, v in kv],
            index_keys=[torch.zeros(index, dtype=self.dtype, device=self.device)
                        for _ in range(n if ix is not None else 0)],
            linear=[None] * n,
        )

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        lo = self.tp.rank * self.vocab_rows
        local = ids - lo
        mine = (local >= 0) & (local < self.vocab_rows)
        h = F.embedding(local.clamp(0, self.vocab_rows - 1), self.model.embed_tokens.weight)
        return self.tp.all_reduce(h.masked_fill(~mine[..., None], 0))

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Float32 logits ``[B, S, vocab_size]`` for ``input_ids`` ``[B, S]`` (collective).

        Without a cache the tokens sit at positions ``0..S-1``.  With one they continue it
        (positions ``cache.length + 0..S-1``; prefill an empty cache, then decode one token
        at a time) and the cache grows by ``S``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        ids = input_ids.to(self.device)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.spec.vocab_size})")
        b, s = ids.shape
        start = 0 if cache is None else cache.length
        if cache is not None and start + s > cache.capacity:
            raise ValueError(f"KV cache holds {cache.capacity} positions; {start} + {s} do not fit")
        positions = torch.arange(start, start + s, device=self.device).expand(b, s)
        cos, sin = rope_cos_sin(self.spec, positions, self.dtype)
        h = self._embed(ids)
        for layer in self.model.layers:
            h = layer(h, cos, sin, cache)
        if cache is not None:
            cache.length += s
        h = rms_norm(h, self.model.norm.weight, self.spec.rms_norm_eps, self.spec.norm_offset)
        head = self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head
        logits = self.tp.all_gather_last(F.linear(h, head.weight))
        return logits[..., : self.spec.vocab_size].float()

    def _check_tokens(self, seqs: Sequence[Sequence[int]], what: str) -> None:
        for i, seq in enumerate(seqs):
            if not seq:
                raise ValueError(f"{what} {i} is empty; it needs at least one token")
            if min(seq) < 0 or max(seq) >= self.spec.vocab_size:
                raise ValueError(f"{what} {i} has token ids outside [0, {self.spec.vocab_size})")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, *,
                 stop_token_ids: Sequence[int] = ()) -> list[Generation]:
        """Sample up to ``max_new_tokens`` after each prompt: ``[(new tokens, logprobs)]`` (collective).

        Greedy when ``temperature == 0``.  Prompt ``i`` samples from its own CPU generator
        seeded from ``(seed, i)``, so results do not depend on batching or on the TP size
        beyond float rounding.  Every rank samples, then group rank 0's token is broadcast so
        ranks can never diverge.  A logprob is that of the chosen token under the policy's
        plain distribution, ``log_softmax(raw logits)``: not temperature- or top-p-adjusted,
        so it equals ``score()`` of the same sequence.  Generation stops after a token in
        ``stop_token_ids`` (which is returned).  Prompts run one at a time; ``start`` and
        ``step`` are the same thing one token at a time (the engine's scheduler uses them).
        """
        seqs = [self.start(p, max_new_tokens, temperature, top_p, prompt_seed(seed, i),
                           stop_token_ids=stop_token_ids) for i, p in enumerate(prompts)]
        for seq in seqs:
            while not seq.done:
                self.step(seq)
        return [(seq.tokens, seq.logprobs) for seq in seqs]

    def start(self, prompt: Sequence[int], max_new_tokens: int, temperature: float = 1.0,
              top_p: float = 1.0, seed: int = 0, *, stop_token_ids: Sequence[int] = ()) -> Decoding:
        """A sequence ready to decode (no forward yet: every token's forward runs in its own
        ``step``, so the weights a token was sampled from are the ones of that step)."""
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        self._check_tokens([prompt], "prompt")
        limit = self.spec.max_position_embeddings
        if len(prompt) + max_new_tokens > limit:
            raise ValueError(f"prompt + max_new_tokens exceeds max_position_embeddings={limit}")
        return Decoding(list(prompt), max_new_tokens, temperature, top_p, set(stop_token_ids),
                        torch.Generator().manual_seed(seed), done=max_new_tokens == 0)

    def step(self, seq: Decoding) -> None:
        """One token for ``seq`` (collective): forward what the cache lacks, sample, append."""
        if seq.done:
            return
        if seq.cache is None:  # first step, or the cache was dropped (weights changed)
            seq.cache = self.new_cache(1, len(seq.prompt) + seq.max_new_tokens)
            feed = seq.prompt + seq.tokens
        else:
            feed = seq.tokens[-1:]
        last = self(torch.tensor([feed], dtype=torch.long), seq.cache)[0, -1].cpu()
        token = sample_token(last, seq.temperature, seq.top_p, seq.generator)
        picked = torch.tensor([token, float(torch.log_softmax(last, -1)[token])],
                              dtype=torch.float64, device=self.device)
        picked = self.tp.broadcast_from_first(picked)
        seq.tokens.append(int(picked[0]))
        seq.logprobs.append(float(picked[1]))
        seq.done = seq.tokens[-1] in seq.stop or len(seq.tokens) == seq.max_new_tokens
        if seq.done:
            seq.cache = None

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities of each token given the tokens before it (collective).

        Entry ``j`` of a result is ``log p(seq[j+1] | seq[:j+1])`` under ``log_softmax`` of
        the raw logits, so a sequence of ``n`` tokens gets ``n - 1`` values (the first token
        has no context and is omitted).
        """
        self._check_tokens(sequences, "sequence")
        out = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long)
            logp = torch.log_softmax(self(ids)[0, :-1], dim=-1)
            out.append(logp.gather(-1, ids[0, 1:, None].to(logp.device))[:, 0].tolist())
        return out
