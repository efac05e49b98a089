"""One trainer rank's GRPO loop, independent of how the rank was started.

The embedded demo (``shardsync.demo``) starts its ranks with ``torch.multiprocessing``;
launchers in this package (Ray) start them elsewhere and call ``trainer_rank`` there.  The
loop is the demo's: rollouts from the engines, trainer logprobs, GRPO loss, optimizer step,
then one weight update per mode with an optional bitwise check.  Rows have the demo's shape,
so ``shardsync.demo.report`` prints them.

Collective contract: every trainer rank iterates ``trainer_rank`` with the same ``cfg`` and
``where`` (except ``rank``), step by step, in lockstep; only rank 0 calls the engines' HTTP
API for rollouts (the batch reaches the others through the trainer's default group).
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from shardsync.demo import DemoConfig, task
from shardsync.launch.serving import serving
from shardsync.placement import rank_device
from shardsync.runtime.record import UpdateRecord

if TYPE_CHECKING:
    from shardsync.models.training import LossFn, StepStats

log = logging.getLogger(__name__)


class _Trainer(Protocol):
    """What the loop asks of a trainer rank, the reference one (``TrainerModel``) or FSDP2's
    (``Fsdp2Trainer``)."""

    def policy_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    def train_step(self, input_ids: torch.Tensor, loss_fn: LossFn, *, lr: float | None = None) -> StepStats: ...

    def synced(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True, kw_only=True)
class RankSite:
    """Where one trainer rank meets the others and the engines.

    ``init_method`` is trainer rank 0's default-group address (``tcp://ip:port``);
    ``sync_host`` is the address rank 0 hosts the sync rendezvous (TCPStore) on, reachable
    from every engine; ``engines`` are the engine servers' base URLs; ``delta_dir`` is the
    directory delta-over-disk publishes to (every engine must read it: a shared filesystem
    when engines run on other nodes).
    """

    rank: int
    init_method: str
    sync_host: str
    engines: tuple[str, ...]
    delta_dir: str | None = None
    records_path: str | None = None  # rank 0 appends one JSON line per update ("{rank}": every rank, its own)
    detail: bool = False  # per-bucket times in the records (a timeline can be drawn from them)


@dataclass(frozen=True)
class StepResult:
    """One step as rank 0 saw it: the demo's row, the modes it updated with, the records."""

    row: dict
    modes: tuple[str, ...]
    records: tuple[UpdateRecord, ...]


def initial_weights(cfg: DemoConfig):
    """Initial trainer weights: the checkpoint when ``cfg.model`` is a directory, else the
    preset's random weights (the same ones an engine started with that seed holds)."""
    from shardsync.models.weights import checkpoint_source, random_source
    from shardsync.presets import load_spec

    spec = load_spec(cfg.model)
    if Path(cfg.model).is_dir():
        return spec, checkpoint_source(cfg.model)
    return spec, random_source(spec, cfg.seed)


def rollouts(cfg: DemoConfig, engines: Sequence[str], step: int, vocab: int, version: int) -> dict:
    """Rank 0: ``cfg.prompts`` prompts spread round-robin over the engines (all engines
    asked at once), ``cfg.group`` samples each, scored by ``task.reward``."""
    client = serving(cfg.engine)
    prompts = task.make_prompts(step, cfg.prompts, cfg.prompt_len, vocab, cfg.seed)
    batches = [[p for i, p in enumerate(prompts) if i % len(engines) == e for _ in range(cfg.group)]
               for e in range(len(engines))]

    def generate(e: int) -> list:
        if not batches[e]:
            return []
        samples, got = client.generate(engines[e], batches[e], max_new_tokens=cfg.max_new_tokens,
                                        temperature=1.0, seed=cfg.seed * 7919 + step, timeout_s=cfg.timeout_s)
        if got != version:
            raise RuntimeError(f"{engines[e]} answered with weight version {got}, expected {version}")
        return samples

    with ThreadPoolExecutor(len(engines)) as pool:
        outputs = list(pool.map(generate, range(len(engines))))
    ids, logprobs, rewards = [], [], []
    for batch, outs in zip(batches, outputs, strict=True):
        for prompt, out in zip(batch, outs, strict=True):
            ids.append(prompt + out.tokens)
            logprobs.append(out.logprobs)
            rewards.append(task.reward(out.tokens, vocab))
    return {"ids": ids, "engine_logprobs": logprobs, "rewards": rewards}


def engine_logprobs(url: str, seqs: list[list[int]], cfg: DemoConfig) -> torch.Tensor:
    return serving(cfg.engine).score(url, seqs, timeout_s=cfg.timeout_s)


def _dp_rows(n: int, par, rank: int) -> slice:
    """The rollouts DP replica ``rank``'s belongs to trains on (contiguous, near-equal)."""
    d, size = par.data_rank(rank)
    return slice(d * n // size, (d + 1) * n // size)


def trainer_rank(cfg: DemoConfig, where: RankSite, *, verify: bool = True) -> Iterator[StepResult]:
    """Run one trainer rank for ``cfg.steps`` steps, yielding after each step's updates.

    Joins the trainer's default group at ``where.init_method`` (gloo), builds the model
    (``TrainerModel``) and the sync (``WeightSync``, rendezvous on ``where.sync_host``),
    and tears both down when the generator finishes or is closed.  ``verify=False`` skips
    the bitwise checksum after each update (``checksum_ok`` is then None).
    """
    from shardsync.config import (
        ColocatedConfig,
        ControlConfig,
        DeltaConfig,
        SyncConfig,
        TransportConfig,
    )
    from shardsync.control.ranks import share_json
    from shardsync.layout import Fsdp2Parallel
    from shardsync.models.trainer import TrainerModel, megatron_groups
    from shardsync.models.training import OptimConfig, grpo_loss
    from shardsync.sync import WeightSync
    from shardsync.vocab import Channel, DeltaTransport, Request

    torch.set_num_threads(1)
    rank = where.rank
    par = cfg.trainer
    dist.init_process_group("gloo", init_method=where.init_method, rank=rank,
                            world_size=par.world_size,
                            timeout=datetime.timedelta(seconds=cfg.timeout_s))
    sync = None
    try:
        spec, source = initial_weights(cfg)
        device = torch.device(rank_device(cfg.device, rank))
        model: _Trainer
        if isinstance(par, Fsdp2Parallel):  # a real transformers model under fully_shard; the sync reads its shards
            from shardsync.models.fsdp2_trainer import Fsdp2Trainer

            model = Fsdp2Trainer(spec, par, source, optim=OptimConfig(lr=cfg.learning_rate), lora=cfg.lora,
                                 lora_seed=cfg.seed)
        else:
            groups = megatron_groups(par, timeout_s=cfg.timeout_s, moe=spec.is_moe)
            model = TrainerModel(spec, par, rank, groups.tp, groups.pp, dp_group=groups.dp, expert_group=groups.expert,
                                 expert_dp_group=groups.expert_dp, source=source,
                                 optim=OptimConfig(lr=cfg.learning_rate), timeout_s=cfg.timeout_s, device=device,
                                 lora=cfg.lora, lora_seed=cfg.seed)
        params = model.synced()
        # the demo's strings as the config's words (parsed as the config would, naming the same choices)
        request = Request.AUTO if cfg.mode in ("both", "delta") else Request.parse(cfg.mode, "mode")
        delta = (DeltaConfig(transport=DeltaTransport.parse(cfg.delta_transport, "delta transport"),
                             dir=where.delta_dir) if cfg.mode == "delta" else None)
        channel = Channel.VLLM if cfg.engine == "vllm" else Channel.STORE
        sync = WeightSync(spec, par, rank, params, list(where.engines),
                          SyncConfig(mode=request,
                                     transport=TransportConfig(bucket_mb=cfg.bucket_mb, timeout_s=cfg.timeout_s,
                                                               host=where.sync_host),
                                     delta=delta,
                                     colocated=ColocatedConfig() if cfg.uses_ipc else None,
                                     control=ControlConfig(channel=channel),
                                     records_path=where.records_path, detail=where.detail, lora=cfg.lora),
                          trainer_group=dist.group.WORLD)
        sync.connect()
        if cfg.mode == "both":
            modes = [m for m in cfg.modes if m in sync.modes]
        else:  # delta: the sync picks a delta or a full update per step
            assert sync.mode is not None  # connected
            modes = ["delta"] if cfg.mode == "delta" else [sync.mode]
        for step in range(1, cfg.steps + 1):
            batch = share_json(rollouts(cfg, where.engines, step, spec.vocab_size, step - 1) if rank == 0
                               else None, rank=rank, world=par.world_size, group=dist.group.WORLD)
            every = torch.tensor(batch["ids"], dtype=torch.long, device=device)
            rows = _dp_rows(len(every), par, rank)  # this DP replica's share of the rollouts
            ids = every[rows]
            start = cfg.prompt_len - 1  # first position whose next token was sampled
            mask = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=device)
            mask[:, start:] = 1.0
            old = model.policy_logprobs(every)  # every replica scores every rollout (the log line)
            rewards = torch.tensor(batch["rewards"])
            loss = functools.partial(grpo_loss, old_logprobs=old[rows], mask=mask,
                                     advantages=task.group_advantages(rewards, cfg.group)[rows].to(device))
            stats = model.train_step(ids, loss)
            old = old.cpu()
            new = model.policy_logprobs(every)[:, start:].cpu()  # the weights about to be synced
            records, updates = [], {}
            for mode in modes:
                rec = sync.update(step, mode=None if mode == "delta" else mode)
                bad = sync.verify() if verify else None
                # train/engine agreement right after this path's update: an engine scores the batch
                scored = engine_logprobs(where.engines[0], batch["ids"], cfg) if rank == 0 else None
                records.append(rec)
                updates[mode] = {"phases": rec.phases, "pause_s": rec.pause_s,
                                 "busiest_link_bytes": rec.busiest_link_bytes,
                                 "bytes": sum(rec.link_bytes.values()), "buckets": rec.buckets,
                                 "checksum_ok": None if bad is None else not bad,
                                 "mismatch": (bad or [])[:5], "fallback": rec.fallback_reason,
                                 "path": rec.mode, "delta": rec.delta, "adapter": rec.adapter,
                                 "logprob_abs_diff": None if scored is None else
                                 float((new - scored[:, start:]).abs().mean())}
            lp_diff = (old[:, start:] - torch.tensor(batch["engine_logprobs"])).abs().mean()
            row = {"step": step, "reward": float(rewards.mean()), "loss": stats.loss,
                   "grad_norm": stats.grad_norm, "logprob_abs_diff": float(lp_diff),
                   "version": step, "updates": updates}
            yield StepResult(row, tuple(modes), tuple(records))
    finally:
        if sync is not None:
            sync.close()
        dist.destroy_process_group()
