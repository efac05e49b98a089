"""The reference trainer: a Megatron-core-layout TP/PP/DP decoder with AdamW, in plain PyTorch.

Parameters are exactly ``megatron_layout(spec, par).ranks[rank]`` (Megatron-core ``GPTModel``
names and TP-local shapes, fp32 master weights), so a sync reads them through
``named_parameters()`` as it would read a real Megatron model.  The math is
``shardsync.models.ops`` (written to match ``transformers``); the parallel scheme is
Megatron's, without sequence parallelism:

- vocab-parallel embedding: rank ``r`` looks up padded rows ``[r*P, (r+1)*P)``, other ids
  give zeros, then all-reduce;
- column-parallel ``linear_qkv`` / ``linear_fc1`` / ``output_layer`` whose input passes an
  identity-forward / all-reduce-backward function; row-parallel ``linear_proj`` /
  ``linear_fc2`` followed by an all-reduce-forward / identity-backward function;
- vocab-parallel log-softmax: log-probabilities of target tokens are computed from the
  local logit shard with three small all-reduces (max, target logit, sum of exponentials);
  full logits are never gathered for training.  Padded vocab columns are excluded (masked
  to ``-inf``) so results equal ``transformers`` on the unpadded vocab;
- pipeline: the whole batch is one micro-batch.  Stage ``s`` receives hidden states from
  ``s-1``, runs its layers and sends to ``s+1``; backward sends the input gradient back.
- tied embeddings with PP > 1: the last stage's ``output_layer.weight`` copy and the first
  stage's embedding exchange gradients before the step (Megatron's embedding group), so
  both copies stay bitwise equal;
- DP replicas hold the same parameters; gradients are averaged over the DP group.
- experts (sparse layers): the replicated router picks each token's top-k experts, the expert
  group (ETP x EP ranks, Megatron's expert rank generator) gathers its members' tokens, each
  rank runs its local experts on its ETP slice and the partial outputs are summed back to
  their tokens (``ExpertExchange``: an all-gather dispatcher).  Expert gradients are summed
  over the expert-DP group and scaled like the dense ones, so every DP batch counts once.

Collective contract: every rank of the model calls each public method that runs the model
(``logits``, ``forward_logprobs``, ``policy_logprobs``, ``forward_backward``,
``finish_grad_sync``, ``optimizer_step``, ``train_step``) in the same order.  All ranks of
one DP replica pass the same ``input_ids``; ``loss_fn`` is only called on the last stage.
Results are returned on every rank.  With ``tp == pp == dp == 1`` nothing communicates and
no process group is needed.

Only "Case A" tensor parallelism (``tp`` divides ``num_kv_heads``) is implemented.

Over 400 lines on purpose: one model, its TP/PP/EP scheme, pipeline schedule and optimizer are
the reference a sync is checked against, and read best in one place (its layers are
``models.trainer_layers``, the step's terms ``models.training``, the math ``models.ops``).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardsync.family.section import Indexer
from shardsync.layout import Layout, MegatronParallel, RankLayout, megatron_layout
from shardsync.layout.logical import mtp_layers
from shardsync.lora import TARGETS, Lora, megatron_adapter_layout
from shardsync.models.latent import Baton
from shardsync.models.lora import LoraWeights, initial_adapter, trainer_terms
from shardsync.models.ops import rms_norm, rope_cos_sin
from shardsync.models.parallel import (
    Comm,
    ExpertExchange,
    TrainerGroups,
    VocabParallelLogprob,
    check_group,
    expert_group_ranks,
    megatron_groups,
)
from shardsync.models.trainer_layers import GqaAttention, Layer, MtpLayer, Weights, mark_tp
from shardsync.models.training import LossFn, OptimConfig, StepStats
from shardsync.models.weights import TensorSource, load_rank
from shardsync.spec import ModelSpec

__all__ = ["TrainerGroups", "TrainerModel", "megatron_groups"]


def _reduce_grads(comm: Comm, grads: list[torch.Tensor], divisor: int) -> None:
    """Sum ``grads`` over ``comm`` (one flat all-reduce) and divide them by ``divisor``."""
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]))
    flat.div_(divisor)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


class TrainerModel(nn.Module):
    """One rank of a Megatron-layout trainer: its parameters, forward, backward and AdamW.

    ``rank`` is the rank within the model (Megatron order, see ``MegatronParallel.coords``);
    ``tp_group``/``pp_group``/``dp_group`` are that rank's groups (``megatron_groups``
    makes them), required when the dimension is > 1, and their group ranks must be the
    rank's TP/PP/DP coordinates.  ``source`` fills the parameters through ``load_rank``
    (None: zeros, to be loaded later).  Parameters are fp32; ``compute_dtype`` (fp32 or
    bf16) is what forward casts weights and activations to.  ``timeout_s`` bounds every
    collective and pipeline send/receive.  ``lora``: the base frozen and a LoRA adapter trained
    (zeroed; from PEFT's start drawn with ``lora_seed`` when given).
    """

    def __init__(self, spec: ModelSpec, par: MegatronParallel, rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None,
                 pp_group: dist.ProcessGroup | None = None, *,
                 dp_group: dist.ProcessGroup | None = None, expert_group: dist.ProcessGroup | None = None,
                 expert_dp_group: dist.ProcessGroup | None = None, source: TensorSource | None = None,
                 compute_dtype: torch.dtype = torch.float32, optim: OptimConfig | None = None,
                 device: str | torch.device = "cpu",
                 timeout_s: float = 60.0, lora: Lora | None = None, lora_seed: int | None = None) -> None:
        super().__init__()
        if par.tp > spec.num_kv_heads or spec.num_kv_heads % par.tp:
            raise ValueError(
                f"tp={par.tp} does not divide num_kv_heads={spec.num_kv_heads} of {spec.name}: "
                "the reference trainer implements only tp <= num_kv_heads (Case A, whole "
                "query groups per rank); use a smaller tp")
        if compute_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"compute_dtype must be torch.float32 or torch.bfloat16, got {compute_dtype}")
        if not 0 <= rank < par.world_size:
            raise ValueError(f"rank {rank} outside the model's {par.world_size} ranks")
        starts = [stage[0] for stage in par.stage_layers(spec.num_layers) if stage]
        if shared := sorted(set(starts) & set(ix.index_shared_layers if (ix := spec.find(Indexer)) else ())):
            raise ValueError(f"a pipeline stage starts on layer {shared[0]}, which reuses the indexer choice of the "
                             "layer before (sparse attention): move the stage boundary")
        self.spec, self.par, self.rank = spec, par, rank
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        self.optim_config = optim or OptimConfig()
        self.layout: Layout = megatron_layout(spec, dataclasses.replace(par, dtype="float32"))
        self.rank_layout: RankLayout = self.layout.ranks[rank]
        pp_rank, dp_rank, tp_rank = par.coords(rank)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.tp = Comm(check_group(tp_group, "tp", tp_rank, par.tp), tp_rank, par.tp, timeout)
        self.pp = Comm(check_group(pp_group, "pp", pp_rank, par.pp), pp_rank, par.pp, timeout)
        self.dp = Comm(check_group(dp_group, "dp", dp_rank, par.dp), dp_rank, par.dp, timeout)
        self.exchange: ExpertExchange | None = None
        if spec.is_moe:
            self._init_experts(expert_group, expert_dp_group, timeout)
        self.first, self.last = pp_rank == 0, pp_rank == par.pp - 1
        self.vocab_rows = par.padded_vocab(spec.vocab_size) // par.tp
        self.vocab_start = tp_rank * self.vocab_rows

        if source is not None:
            tensors = load_rank(self.layout, rank, source, device=self.device)
        else:
            tensors = {t.name: torch.zeros(t.shape, device=self.device) for t in self.rank_layout.tensors}
        if self.first or (self.last and mtp_layers(spec)):  # MTP embeds on the last stage (its own copy)
            self.embedding = nn.Module()
            self.embedding.word_embeddings = Weights(
                tensors, "embedding.word_embeddings", ("weight",), tp_sharded=True)
        self.expert_params: set[int] = set()  # ids of the routed experts' parameters (``_Experts``)
        self.baton = Baton()  # sparse attention: the last indexer choice, for the layers that reuse it
        self.decoder = nn.Module()
        layers = par.stage_layers(spec.num_layers)[pp_rank]
        self.decoder.layers = nn.ModuleList(
            Layer(self, tensors, f"decoder.layers.{i}.", layer) for i, layer in enumerate(layers))
        if self.last:
            self.decoder.final_layernorm = Weights(
                tensors, "decoder.final_layernorm", ("weight",), tp_sharded=False)
            if mtp_layers(spec):
                self.mtp = nn.Module()
                self.mtp.layers = nn.ModuleList(MtpLayer(self, tensors, f"mtp.layers.{k}.", layer)
                                                for k, layer in enumerate(mtp_layers(spec)))
            if "output_layer.weight" in tensors:
                self.output_layer = Weights(tensors, "output_layer", ("weight",), tp_sharded=True)
        assert not tensors, f"layout tensors not placed in the module: {sorted(tensors)}"
        names = [n for n, _ in self.named_parameters()]
        assert names == [t.name for t in self.rank_layout.tensors], names
        self.lora = lora
        self.adapter: LoraWeights | None = None
        if lora is not None:
            self._init_adapter(lora)
            if lora_seed is not None:  # PEFT's start: A random, B zero (an engine's zeroed adapter is the same)
                self.load_adapter(initial_adapter(spec, lora, lora_seed))

        trained = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in trained if p.dim() > 1]
        no_decay = [p for p in trained if p.dim() <= 1]
        cfg = self.optim_config
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
        self._grads_synced = True

    def _init_adapter(self, lora: Lora) -> None:
        """Freeze the base and hold the adapter (zeroed; ``load_adapter`` fills it), sharded as
        Megatron shards each target's base linear (``lora.table``)."""
        self.requires_grad_(False)
        par = dataclasses.replace(self.par, dtype="float32")
        self.adapter_layout = megatron_adapter_layout(self.spec, lora, par)
        self.adapter = LoraWeights(self.adapter_layout.ranks[self.rank], self.device, trainable=True)
        layers = cast(Sequence[Layer], self.decoder.layers)  # a ModuleList of this stage's layers
        for i in range(len(layers)):
            for name in lora.targets:  # a column target's B and a row target's A are the sharded ones
                t = TARGETS[name]
                mark_tp(self.adapter.get_parameter(f"decoder.layers.{i}.{t.megatron}.linear_in.weight"), not t.column)
                mark_tp(self.adapter.get_parameter(f"decoder.layers.{i}.{t.megatron}.linear_out.weight"), t.column)
        tp, dtype = self.tp, self.compute_dtype

        def cast_weight(weight: torch.Tensor, replicated: bool) -> torch.Tensor:
            return (tp.copy_to(weight) if replicated else weight).to(dtype)

        for i, layer in enumerate(layers):
            terms = trainer_terms(self.adapter, lora, f"decoder.layers.{i}.", cast_weight)
            layer.lora = terms  # ``lora.check_lora``: GQA attention, dense MLPs
            cast(GqaAttention, layer.self_attention).lora = terms

    def synced(self) -> dict[str, torch.Tensor]:
        """What a sync reads on this rank: every parameter, or the adapter's alone when it trains
        one; detached views (the same storage, read in place, never part of an autograd graph)."""
        held = self.named_parameters() if self.adapter is None else self.adapter_tensors().items()
        return {n: p.detach() for n, p in held}

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's parameters by layout name (what an adapter sync reads)."""
        assert self.adapter is not None, "adapter_tensors needs a trainer built with lora="
        return self.adapter.tensors()

    @torch.no_grad()
    def load_adapter(self, source: TensorSource) -> None:
        """Overwrite the adapter with this rank's pieces of ``source`` (PEFT's logical tensors)."""
        tensors = load_rank(self.adapter_layout, self.rank, source, device=self.device)
        for name, t in self.adapter_tensors().items():
            t.copy_(tensors[name])

    def _init_experts(self, group: dist.ProcessGroup | None, dp_group: dist.ProcessGroup | None,
                      timeout: datetime.timedelta) -> None:
        par = self.par
        size = par.expert_tp * par.ep
        if size % par.tp and par.tp % size:
            raise ValueError(f"etp x ep = {size} and tp = {par.tp}: the reference trainer needs one to divide "
                             "the other (its expert groups hold whole DP batches or whole expert copies)")
        members = expert_group_ranks(par, self.rank)
        comm = Comm(check_group(group, "expert", members.index(self.rank), size), members.index(self.rank),
                    size, timeout)
        batch = [par.coords(r)[1] for r in members]  # members holding the same DP batch share tokens
        self.exchange = ExpertExchange(comm, [batch.count(b) for b in batch])
        _, edp, _, _ = par.expert_coords(self.rank)
        self.expert_dp = Comm(check_group(dp_group, "expert_dp", edp, par.expert_dp), edp, par.expert_dp, timeout)
        # each DP batch's expert gradient arrives once per expert group it spans
        self.expert_grad_divisor = par.dp * max(1, par.tp // size)

    # --- pieces of the forward ---------------------------------------------------------------

    def _cast(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.compute_dtype)

    @property
    def tied_copy(self) -> bool:
        """Whether this rank holds one of the two copies of the embedding that megatron-core
        keeps equal over the first and last stage (PP > 1): a tied output layer's, or the one
        the MTP layers embed with."""
        copies = self.spec.tie_word_embeddings or bool(mtp_layers(self.spec))
        return copies and self.par.pp > 1 and (self.first or self.last)

    def _output_weight(self) -> torch.Tensor:
        if hasattr(self, "output_layer"):
            return self.output_layer.weight
        return cast(Weights, self.embedding.word_embeddings).weight  # tied, PP == 1

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_rows)
        rows = F.embedding(local.masked_fill(outside, 0),
                           self._cast(cast(Weights, self.embedding.word_embeddings).weight))
        return self.tp.reduce_from(rows.masked_fill(outside[..., None], 0.0))

    def _stage(self, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run this stage: (received input or None on the first stage, output).

        The last stage's output is the final-normed hidden state; other stages send theirs
        to the next stage before returning.
        """
        b, s = ids.shape
        if self.first:
            h_in, h = None, self._embed(ids)
        else:
            h_in = self.pp.recv(torch.empty(b, s, self.spec.hidden_size, dtype=self.compute_dtype,
                                            device=self.device),
                                self.pp.rank - 1)
            h = h_in.requires_grad_(torch.is_grad_enabled())
        cos, sin = rope_cos_sin(self.spec, torch.arange(s, device=self.device)[None], self.compute_dtype)
        for layer in cast(nn.ModuleList, self.decoder.layers):
            h = layer(h, cos, sin)
        if not self.last:
            self.pp.send(h.detach(), self.pp.rank + 1)
            return h_in, h
        return h_in, rms_norm(h, self._cast(cast(Weights, self.decoder.final_layernorm).weight),
                              self.spec.rms_norm_eps, self.spec.norm_offset)

    def _local_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of this rank's vocab shard; padded vocab columns are -inf."""
        logits = F.linear(self.tp.copy_to(h), self._cast(self._output_weight())).float()
        pad = self.vocab_start + self.vocab_rows - self.spec.vocab_size
        if pad > 0:
            cols = torch.arange(self.vocab_rows, device=self.device) + self.vocab_start >= self.spec.vocab_size
            logits = logits.masked_fill(cols, float("-inf"))
        return logits

    def _logprobs(self, h: torch.Tensor, ids: torch.Tensor,
                  targets: torch.Tensor | None) -> torch.Tensor:
        if targets is None:
            h, targets = h[:, :-1], ids[:, 1:]
        return VocabParallelLogprob.apply(self._local_logits(h), targets, self.vocab_start,
                                           self.tp)

    def _from_last(self, x: torch.Tensor | None, shape: Sequence[int],
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The last stage's ``x`` on every stage (broadcast over the PP group)."""
        buf = x.detach().contiguous() if x is not None else torch.empty(tuple(shape), dtype=dtype, device=self.device)
        return self.pp.broadcast(buf, self.par.pp - 1)

    def _check_ids(self, ids: torch.Tensor, name: str = "input_ids", min_len: int = 2) -> None:
        if ids.dim() != 2 or ids.dtype != torch.long or ids.shape[1] < min_len:
            raise ValueError(f"{name} must be int64 [batch, seq] with seq >= {min_len}, "
                             f"got {ids.dtype} {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.spec.vocab_size):
            raise ValueError(f"{name} must be token ids in [0, {self.spec.vocab_size})")

    # --- public API ----------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full fp32 logits ``[batch, seq, vocab_size]`` on every rank (tests/debugging).

        Gathers the vocab shards over TP and broadcasts over PP: fine for tiny models only;
        training never materialises full logits.
        """
        self._check_ids(input_ids, min_len=1)
        _, h = self._stage(input_ids)
        full = None
        if self.last:
            full = torch.cat(self.tp.all_gather(self._local_logits(h)), dim=-1)
            full = full[..., :self.spec.vocab_size].contiguous()
        return self._from_last(full, (*input_ids.shape, self.spec.vocab_size))

    @torch.no_grad()
    def forward_logprobs(self, input_ids: torch.Tensor,
                         targets: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 log-probabilities on every rank, computed vocab-parallel (no full logits).

        Without ``targets``: of ``input_ids[:, 1:]`` given their prefixes, ``[batch, seq-1]``.
        With ``targets`` ``[batch, seq]``: of ``targets[:, j]`` at position ``j``.  No attention
        mask: pad sequences on the right and mask the loss instead.
        """
        self._check_ids(input_ids, min_len=1 if targets is not None else 2)
        if targets is not None:
            if targets.shape != input_ids.shape:
                raise ValueError(f"targets {tuple(targets.shape)} must have input_ids' shape "
                                 f"{tuple(input_ids.shape)}")
            self._check_ids(targets, "targets", min_len=1)
        _, h = self._stage(input_ids)
        lp = self._logprobs(h, input_ids, targets) if self.last else None
        b, s = input_ids.shape
        return self._from_last(lp, (b, s if targets is not None else s - 1))

    def policy_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """GRPO's per-token log-probabilities of ``input_ids[:, 1:]``, ``[batch, seq-1]``, every rank."""
        return self.forward_logprobs(input_ids)

    def forward_backward(self, input_ids: torch.Tensor, loss_fn: LossFn) -> float:
        """Forward and backward through the pipeline; gradients accumulate into ``.grad``.

        ``loss_fn(logprobs [batch, seq-1]) -> scalar`` runs on the last stage only (other
        stages may pass anything).  Returns the loss on every rank.  Call
        ``optimizer_step`` (or ``train_step``) to apply; several calls accumulate.
        """
        self._check_ids(input_ids)
        self._grads_synced = False
        h_in, h = self._stage(input_ids)
        loss = None
        if self.last:
            loss = loss_fn(self._logprobs(h, input_ids, None))
            if loss.dim() != 0:
                raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
            loss.backward()
        else:
            h.backward(self.pp.recv(torch.empty_like(h), self.pp.rank + 1))
        if h_in is not None:
            grad = h_in.grad if h_in.grad is not None else torch.zeros_like(h_in)
            self.pp.send(grad, self.pp.rank - 1)
        value = loss.detach().double() if loss is not None else None
        return float(self._from_last(value, (), torch.float64))

    def finish_grad_sync(self) -> None:
        """Average gradients over DP, then sum the two tied-embedding copies (PP > 1).

        ``optimizer_step`` calls it; call it yourself only to read the final gradients
        before the step.  A second call before the next ``forward_backward`` does nothing.
        DP runs first so that the tied exchange is the last write: both copies end with
        bitwise equal gradients.
        """
        if self._grads_synced:
            return
        # every parameter ends with a gradient (zeros where frozen: MTP layers, an indexer), except a
        # LoRA trainer's frozen base, which takes no gradient memory at all
        held = [p for p in self.parameters() if p.requires_grad or self.adapter is None]
        dense: list[torch.Tensor] = []
        experts: list[torch.Tensor] = []
        for p in held:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            (experts if id(p) in self.expert_params else dense).append(p.grad)
        if self.dp.size > 1:
            _reduce_grads(self.dp, dense, self.dp.size)
        if experts:
            _reduce_grads(self.expert_dp, experts, self.expert_grad_divisor)
        if self.tied_copy and self._tied_param().requires_grad:
            mine = self._tied_param().grad
            assert mine is not None  # every held parameter has one by now
            other = self.pp.exchange(mine, self.par.pp - 1 if self.first else 0)
            first, last = (mine, other) if self.first else (other, mine)
            mine.copy_(first + last)
        self._grads_synced = True

    @property
    def _copy_name(self) -> str:
        """The last stage's copy of the embedding (the first stage's is the embedding)."""
        return "output_layer.weight" if self.spec.tie_word_embeddings else "embedding.word_embeddings.weight"

    def _tied_param(self) -> nn.Parameter:
        if self.first:
            return cast(Weights, self.embedding.word_embeddings).weight
        return self.get_parameter(self._copy_name)

    def grad_norm(self) -> float:
        """Global L2 norm of the gradients (each logical element once), the same on every rank.

        Collective over the TP group, then the PP group (``optimizer_step`` calls it).
        """
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        replicated = torch.zeros((), dtype=torch.float64, device=self.device)
        experts = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, p in self.named_parameters():
            if p.grad is None or (self.tied_copy and self.last and name == self._copy_name):
                continue
            sq = p.grad.double().pow(2).sum()
            if id(p) in self.expert_params:
                experts += sq
            elif p.tensor_model_parallel:  # type: ignore[attr-defined]  # Megatron's, set by mark_tp
                sharded += sq
            else:
                replicated += sq
        # Sums in rank order (not all_reduce) so that every rank gets the same bits.
        stage = sum(self.tp.all_gather(sharded)) + replicated
        if self.exchange is not None:
            stage = stage + sum(self.exchange.comm.all_gather(experts))
        return math.sqrt(float(sum(self.pp.all_gather(stage))))

    def optimizer_step(self, lr: float | None = None) -> float:
        """Sync gradients, clip to ``max_grad_norm``, AdamW step, zero gradients.

        Returns the gradient norm before clipping (every rank).  ``lr`` overrides the
        configured learning rate from this step on.
        """
        self.finish_grad_sync()
        norm = self.grad_norm()
        limit = self.optim_config.max_grad_norm
        if limit is not None and norm > limit:
            scale = limit / (norm + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def train_step(self, input_ids: torch.Tensor, loss_fn: LossFn, *,
                   lr: float | None = None) -> StepStats:
        """``forward_backward`` then ``optimizer_step``: one training step on every rank.

        For GRPO: ``train_step(ids, functools.partial(grpo_loss, old_logprobs=...,
        advantages=..., mask=...))``.
        """
        loss = self.forward_backward(input_ids, loss_fn)
        return StepStats(loss=loss, grad_norm=self.optimizer_step(lr))
