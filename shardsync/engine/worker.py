"""One reference-engine TP worker: the model shard, serving it, and hosting a ``Receiver``.

Workers are driven by commands (an ``Op`` word and a plain dict of args, pickled over in-host
queues, never the network) that worker 0 fans out in one order to every worker; each command
is collective over the engine's TP group or the sync group.  The update session lives on
worker 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from shardsync.control.wire import ConnectRequest
from shardsync.lora.merge import merge_plan
from shardsync.mode import Mode
from shardsync.models.decoding import Decoding, prompt_seed
from shardsync.models.engine import EngineModel, Hosting
from shardsync.paths import UpdateArgs
from shardsync.receiver import Destination, Params, Receiver, Staged
from shardsync.receiver.destination import StagingFacts
from shardsync.receiver.merged import Merged
from shardsync.receiver.viewed import EngineRank, wrap
from shardsync.runtime.ledger import RankReport
from shardsync.spec import ModelSpec
from shardsync.views import views_of
from shardsync.vocab import Commit, Op

SHARD = -1  # staging_bytes: exactly one copy of the rank's shard
Notify = Callable[[tuple[int, int, dict]], None]  # (rank, version, report) of a staged receive


def destination_for(params: dict[str, torch.Tensor], staging_bytes: int, *,
                    commit: str | Commit = Commit.SWAP) -> Destination:
    """In place (``staging_bytes == 0``), staged (one shard, ``SHARD``, or a budget that holds
    it), or a staged window of the tensors a receive writes first (a smaller budget)."""
    if staging_bytes == 0:
        return Params(params)
    if staging_bytes < 0 and staging_bytes != SHARD:
        raise ValueError(f"staging_bytes must be 0, a byte count or {SHARD} (one shard), got {staging_bytes}")
    return Staged(params, commit=commit, budget=None if staging_bytes == SHARD else staging_bytes)


def destination_of(model: EngineModel, rank: int, staging_bytes: int) -> Destination:
    """Where a sync writes on this rank, by how the engine hosts it (``Hosting``)."""
    return DESTINATIONS[model.hosting](model, rank, staging_bytes)


def _synced(model: EngineModel, rank: int, staging_bytes: int) -> Destination:
    """The model's synced tensors: its weights, or its adapter's own tensors."""
    return destination_for(model.synced_tensors(), staging_bytes)


def _merged(model: EngineModel, rank: int, staging_bytes: int) -> Destination:
    """The adapter, merged into the base shard (``receiver.merged``), staged or in place."""
    assert model.lora is not None  # merged: an engine built with an adapter
    adapter = model.adapter_layout.ranks[rank]
    steps = merge_plan(model.spec, model.layout.ranks[rank], adapter, model.lora)
    params = dict(model.named_parameters())
    inner = destination_for({n: params[n] for n in dict.fromkeys(s.base for s in steps)}, staging_bytes)
    return Merged(inner, steps, adapter, model.lora, device=model.device)


# how the reference engine takes what a sync writes (``Hosting``: how it hosts it)
DESTINATIONS: dict[Hosting, Callable[[EngineModel, int, int], Destination]] = {
    Hosting.WEIGHTS: _synced, Hosting.ADAPTER: _synced, Hosting.MERGED: _merged}


class EngineWorker:
    def __init__(self, model: EngineModel, rank: int, tp: int, *, secret: str,
                 staging_bytes: int = 0) -> None:
        self.model, self.rank, self.tp = model, rank, tp
        for p in model.parameters():
            p.requires_grad_(False)
        self.ep = model.ep
        # what this engine serves (an FP8 format, an adapter): the trainer composes the same views
        self.views = views_of(model.quantization, model.lora)
        self.destination = wrap(self.views, destination_of(model, rank, staging_bytes),
                                EngineRank(model.spec, model.layout.ranks[rank], model.dtype, model.device))
        self.staging: Staged | None = self.destination.staged()
        self.receiver = Receiver(model.spec, rank, tp, self.destination, dtype=model.dtype, device=model.device,
                                 secret=secret, ep=model.ep, views=self.views)
        self.seqs: dict[int, Decoding] = {}  # sequences being generated, by the dispatcher's id
        self.notify: Notify | None = None  # where a staged receive reports (set by the host)
        self._stage: threading.Thread | None = None
        self._open = threading.Event()  # the dispatcher paused the engine for a window's rest
        self._stream: torch.cuda.Stream | None = None  # CUDA: the stream staged receives run on

    @property
    def staged(self) -> bool:
        return self.staging is not None

    @property
    def staging_facts(self) -> StagingFacts | None:
        return None if self.staging is None else self.staging.facts

    @property
    def spec(self) -> ModelSpec:
        return self.model.spec

    @property
    def dtype(self) -> str:
        return str(self.model.dtype).removeprefix("torch.")

    # -- commands (each one is called on every worker, in the same order) --

    def generate(self, **kw: Any) -> list:
        return self.model.generate(**kw)

    def admit(self, sids: list[int], prompts: list[list[int]], max_new_tokens: int, temperature: float,
              top_p: float, seed: int, stop_token_ids: list[int]) -> None:
        """Start one sequence per prompt (all validated before any is kept)."""
        seqs = [self.model.start(p, max_new_tokens, temperature, top_p, prompt_seed(seed, i),
                                 stop_token_ids=stop_token_ids) for i, p in enumerate(prompts)]
        self.seqs.update((sid, seq) for sid, seq in zip(sids, seqs, strict=True) if not seq.done)

    def step(self, advance: list[int], refill: Sequence[int] = (), drop: Sequence[int] = (),
             tokens: int = 1) -> dict[int, tuple]:
        """Up to ``tokens`` tokens for each sequence in ``advance``: {sid: (tokens, logprobs,
        done)}.  ``refill``: drop their KV caches first (built on weights that changed);
        ``drop``: forget them."""
        for sid in drop:
            self.seqs.pop(sid, None)
        for sid in refill:
            self.seqs[sid].cache = None
        out = {}
        for sid in advance:
            seq = self.seqs[sid]
            n = len(seq.tokens)
            for _ in range(tokens):
                self.model.step(seq)
                if seq.done:
                    break
            out[sid] = (seq.tokens[n:], seq.logprobs[n:], seq.done)
            if seq.done:
                del self.seqs[sid]
        return out

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.model.score(sequences)

    def join(self, req: dict[str, Any]) -> dict[str, Any]:
        """Join the sync group a trainer opened (blocks, bounded, until every member arrives)."""
        return {"rank": self.rank, "sync_rank": self.receiver.join(ConnectRequest.model_validate(req))}

    def update(self, version: int, mode: Mode, commit: bool = True) -> dict[str, Any]:
        """Receive one update into the destination (``commit=False``: a staged receive the
        dispatcher commits later)."""
        t0 = time.perf_counter()
        try:
            stats = self.receiver.receive(mode, UpdateArgs(version=version), commit=commit)
        except Exception as e:  # the receiver left the broken group; the dispatcher settles it
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return RankReport.of(stats, t0, self.receiver.destination.name).model_dump()

    def refuse(self, mode: Mode) -> None:
        """The session refused an update the trainer already signalled: answer it in place."""
        self.receiver.refuse(mode)

    def pull(self, root: str, version: int, current: int, commit: bool = True) -> dict[str, Any]:
        """Apply delta ``version`` from ``root`` (a shared directory) to this rank's weights."""
        t0 = time.perf_counter()
        try:
            stats = self.receiver.pull(root, version, current, commit=commit)
        except Exception as e:
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}
        return RankReport.of(stats, t0, self.receiver.destination.name).model_dump()

    def stage(self, kind: Op, version: int, args: dict[str, Any], wait_s: float = 300.0) -> None:
        """Start ``kind`` (update | pull) into staging on a thread of its own and return: this
        worker keeps serving; the receive reports through ``notify`` when done.  A staging
        window's receive asks for the pause (``{"gate": True}``) before its first in-place
        write and waits, at most ``wait_s``, for ``open``."""
        staging, notify = self.staging, self.notify
        if notify is None or staging is None:
            raise RuntimeError("this worker has no staging destination (staging_bytes=0)")
        if self._stage is not None and self._stage.is_alive():
            raise RuntimeError("the previous staged receive is still running")
        receives: dict[Op, Callable[..., dict[str, Any]]] = {Op.UPDATE: self.update, Op.PULL: self.pull}
        fn = receives[kind]
        device = self.model.device
        self._open.clear()

        def gate() -> None:
            notify((self.rank, version, {"gate": True}))
            if not self._open.wait(wait_s):
                raise TimeoutError(f"the engine did not pause within {wait_s:g}s for the in-place part of "
                                   f"update {version}; nothing in place was written")

        staging.gate = gate

        def body() -> None:
            try:
                with torch.no_grad():  # grad mode is per thread
                    if device.type == "cuda":  # the current device and stream are per thread too
                        torch.cuda.set_device(device)
                        if self._stream is None:  # one side stream for every staged receive
                            self._stream = torch.cuda.Stream(device)
                        stream = self._stream
                        with torch.cuda.stream(stream):
                            report = fn(**args, commit=False)
                        stream.synchronize()
                    else:
                        report = fn(**args, commit=False)
            except Exception as e:  # the dispatcher hears of every staged receive, whatever happened
                staging.discard()
                report = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            report["touched"] = staging.touched  # served weights written (past the gate)
            staging.gate = None  # outside a staged receive nothing waits for a pause
            notify((self.rank, version, report))

        self._stage = threading.Thread(target=body, name=f"stage-v{version}", daemon=True)
        self._stage.start()

    def open(self) -> None:
        """The engine paused: a staging window's receive may write the served weights."""
        self._open.set()

    def commit(self) -> dict[str, Any]:
        """Make the staged receive the served weights (between two forward steps)."""
        if self._stage is not None:
            self._stage.join(30)
            if self._stage.is_alive():
                raise RuntimeError("the staged receive has not finished; nothing committed")
        t0 = time.perf_counter()
        self.receiver.commit()
        return {"commit_s": time.perf_counter() - t0}

    def checksum(self) -> dict:
        return self.receiver.checksums()

    def disconnect(self) -> None:
        self.receiver.leave()

    def handle(self, kind: Op, args: dict[str, Any]) -> Any:
        """Run command ``kind`` on this worker; ValueError for one no worker runs."""
        fn = COMMANDS.get(kind)
        if fn is None:
            raise ValueError(f"unknown engine command {str(kind)!r}")
        if kind in READS and self.staging is not None:
            self.staging.settle()  # a pushed update's copies, before its weights are read
        with torch.no_grad():
            return fn(self, **args)


COMMANDS: dict[Op, Callable[..., Any]] = {
    Op.GENERATE: EngineWorker.generate, Op.ADMIT: EngineWorker.admit, Op.STEP: EngineWorker.step,
    Op.SCORE: EngineWorker.score, Op.JOIN: EngineWorker.join, Op.UPDATE: EngineWorker.update,
    Op.PULL: EngineWorker.pull, Op.REFUSE: EngineWorker.refuse, Op.STAGE: EngineWorker.stage,
    Op.OPEN: EngineWorker.open, Op.COMMIT: EngineWorker.commit, Op.CHECKSUM: EngineWorker.checksum,
    Op.DISCONNECT: EngineWorker.disconnect,
}  # every Op but STAGED (the dispatcher's own)
READS = {Op.GENERATE, Op.ADMIT, Op.STEP, Op.SCORE, Op.CHECKSUM}  # commands that read the served weights
