"""The engine scheduler: when weights change between steps, what running and queued requests
see (crossing policies), staged receives that let steps go on, and every token's version.

The worker is a stand-in (no model, named as such): a "token" is ``100 * served version +
step count``, so a test can tell which weights produced it; its receive waits on a gate.
The real engine runs the same scheduler over real workers in tests/dist/test_serving.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from shardsync.control.session import UpdateSession
from shardsync.control.wire import BeginRequest
from shardsync.engine.dispatch import Aborted, Dispatcher, Serving
from shardsync.receiver.destination import StagingFacts
from shardsync.vocab import Commit, Op

REPORT = {"ok": True, "pack_s": 0.0, "transfer_s": 0.0, "unpack_s": 0.0, "total_s": 0.0, "bytes_received": 7,
          "changed": 0, "buffer_bytes": 0, "buckets": 0, "destination": "params"}




class _StandInWorker:
    """Stands in for EngineWorker: records commands; steps are slow enough to overlap."""

    def __init__(self, staged: bool = False) -> None:
        self.staged, self.notify = staged, None
        self.staging_facts = StagingFacts(Commit.SWAP, 1234, 4096) if staged else None
        self.served, self.staging = 0, None
        self.seqs: dict[int, list[int]] = {}  # sid -> [count, max_new]
        self.order: list[Op] = []
        self.gate = threading.Event()
        self.opened = threading.Event()  # ``open``: the engine paused for a window's rest
        self.refilled: list[int] = []
        self.in_place_steps = 0  # steps run while a window's rest was being written

    def handle(self, kind: Op, args: dict):
        if kind is not Op.STEP:
            self.order.append(kind)
        if kind is Op.ADMIT:
            for sid in args["sids"]:
                self.seqs[sid] = [0, args["max_new_tokens"]]
            return None
        if kind is Op.STEP:
            if self.opened.is_set() and self.staging is None:
                self.in_place_steps += 1
            time.sleep(0.01)
            self.refilled += args["refill"]
            out = {}
            for sid in args["advance"]:
                s = self.seqs[sid]
                s[0] += 1
                out[sid] = ([100 * self.served + s[0]], [-0.5], s[0] == s[1])
            return out
        if kind is Op.UPDATE:  # in place: the receive waits for the trainer (the gate)
            assert self.gate.wait(10)
            self.served = args["version"]
            return dict(REPORT)
        if kind is Op.STAGE:
            self.opened.clear()
            self.staging = None

            def receive() -> None:
                assert self.gate.wait(10)
                fail = args["args"].get("fail", False)
                window = args["args"].get("window", False)  # like a staging window: part in place
                if window:
                    self.notify((0, args["version"], {"gate": True}))
                    assert self.opened.wait(10)
                    time.sleep(0.05)  # the rest lands in place; no step may run meanwhile
                self.staging = args["version"]
                self.notify((0, args["version"], dict(REPORT, ok=not fail, touched=window,
                                                      error="ValueError: cut" if fail else None)))

            threading.Thread(target=receive, daemon=True).start()
            return None
        if kind is Op.OPEN:
            self.opened.set()
            return None
        if kind is Op.COMMIT:
            self.served = self.staging
            return {"commit_s": 0.0}
        return {}


def _engine(staged: bool = False, **serving) -> tuple[_StandInWorker, UpdateSession, Dispatcher]:
    worker, session = _StandInWorker(staged), UpdateSession()
    session.fingerprints = {"p2p": "f", "broadcast": "g"}
    d = Dispatcher(worker, [], None, session, serving=Serving(**serving))
    d.start()
    return worker, session, d


def _update(session: UpdateSession, d: Dispatcher, version: int, **extra):
    session.begin(BeginRequest(version=version, mode="p2p", fingerprint="f"))
    return d.command(Op.UPDATE, {"version": version, "mode": "p2p", **extra})


def _gen(d: Dispatcher, n: int, prompts: int = 1):
    return d.submit(Op.GENERATE, {"prompts": [[1]] * prompts, "max_new_tokens": n, "temperature": 0.0,
                                 "top_p": 1.0, "seed": 0, "stop_token_ids": []})


def _until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _consistent(outs) -> None:
    """Each token's version (its hundreds) is the version of the span holding it."""
    for tokens, _, spans in outs:
        assert spans[0][1] == 0 and spans[-1][2] == len(tokens) - 1
        for version, first, last in spans:
            assert all(t // 100 == version for t in tokens[first:last + 1]), (tokens, spans)


def test_in_place_update_waits_for_running_requests_and_goes_ahead_of_queued_ones() -> None:
    worker, session, d = _engine()
    running = _gen(d, 20)
    _until(lambda: bool(worker.seqs))
    update = _update(session, d, 5)
    queued = [_gen(d, 3) for _ in range(2)]
    worker.gate.set()
    result, version = update.future.result(10)
    assert result.ok and version == 5 and result.staging == "in-place" and result.crossed == 0
    assert result.pause_s > 0 and result.drain_s > 0, "the receive was the pause; it waited for the runner"
    outs, v = running.result(10)
    assert v == 0 and [s[0] for s in outs[0][2]] == [0], "the running request finished on version 0 alone"
    for f in queued:
        outs, v = f.result(10)
        _consistent(outs)
        assert v == 5 and outs[0][2] == [[5, 0, 2]], "requests queued behind the update ran on version 5"
    assert worker.order.index(Op.UPDATE) < worker.order.index(Op.ADMIT, 1)
    d.stop()


def test_staged_receive_lets_generation_go_on_and_only_the_commit_pauses() -> None:
    worker, session, d = _engine(staged=True)
    update = _update(session, d, 3)
    assert update.started.result(10) is None
    during = _gen(d, 5)
    outs, v = during.result(10)  # served while the receive is still held at the gate
    assert v == 0 and not update.future.done() and outs[0][2] == [[0, 0, 4]]
    worker.gate.set()
    result, version = update.future.result(10)
    assert result.ok and version == 3 and result.staging == "swap" and result.staging_bytes == 1234
    assert result.shard_bytes == 4096
    assert result.stage_s > 0 and result.pause_s > 0
    assert worker.order == [Op.STAGE, Op.ADMIT, Op.COMMIT], "served during the receive; only the commit paused"
    outs, v = _gen(d, 2).result(10)
    assert v == 3 and outs[0][2] == [[3, 0, 1]]
    d.stop()


def test_a_failed_staged_receive_keeps_serving_the_old_version() -> None:
    worker, session, d = _engine(staged=True)
    worker.gate.set()
    result, version = _update(session, d, 4, fail=True).future.result(10)
    assert not result.ok and version == 0 and not session.stale and Op.COMMIT not in worker.order
    assert not session.connected, "the broken sync group is dropped: the trainer reconnects"
    outs, v = _gen(d, 2).result(10)
    assert v == 0 and outs[0][0] == [1, 2]
    d.stop()


@pytest.mark.parametrize("crossing", ["finish", "span"])
def test_a_window_receive_pauses_the_engine_for_its_in_place_rest(crossing: str) -> None:
    """A staging window's receive asks for the gate mid-receive: the crossing policy runs, the
    engine stops stepping (``open``) while the rest lands in place, then commits; the pause
    counts from ``open``, and requests that came meanwhile run on the new version."""
    worker, session, d = _engine(staged=True, crossing=crossing)
    running = _gen(d, 15)
    _until(lambda: bool(worker.seqs))
    update = _update(session, d, 6, window=True)
    worker.gate.set()
    _until(worker.opened.is_set)
    during = _gen(d, 2)  # while the engine is paused
    result, version = update.future.result(10)
    assert result.ok and version == 6 and worker.in_place_steps == 0, "no step ran while weights were written"
    assert worker.order.index(Op.STAGE) < worker.order.index(Op.OPEN) < worker.order.index(Op.COMMIT)
    assert result.pause_s >= 0.05 and result.stage_s > 0
    outs, v = running.result(10)
    _consistent(outs)
    assert [s[0] for s in outs[0][2]] == ([0] if crossing == "finish" else [0, 6])
    outs, v = during.result(10)
    assert v == 6 and outs[0][2] == [[6, 0, 1]]
    d.stop()


def test_a_window_receive_that_fails_after_the_pause_leaves_the_engine_stale() -> None:
    """Past the gate the served weights were written: a failure cannot keep them."""
    worker, session, d = _engine(staged=True)
    worker.gate.set()
    result, version = _update(session, d, 4, window=True, fail=True).future.result(10)
    assert not result.ok and session.stale and Op.COMMIT not in worker.order
    d.stop()


@pytest.mark.parametrize("staged", [False, True])
def test_span_policy_marks_requests_that_cross_and_refills_them(staged: bool) -> None:
    worker, session, d = _engine(staged=staged, crossing="span")
    if staged:
        worker.gate.set()
    running = _gen(d, 40, prompts=2)
    _until(lambda: bool(worker.seqs) and d.requests and len(d.requests[0].seqs[0].tokens) >= 3)
    update = _update(session, d, 2)
    worker.gate.set()
    result, _ = update.future.result(10)
    assert result.ok and result.crossed == 2
    outs, v = running.result(10)
    _consistent(outs)
    assert v == 2 and all([s[0] for s in spans] == [0, 2] for _, _, spans in outs)
    assert len(worker.refilled) == 2, "both crossing sequences re-prefill on the new weights"
    d.stop()


def test_abort_policy_ends_running_requests_with_a_retryable_error() -> None:
    worker, session, d = _engine(crossing="abort")
    running = _gen(d, 40)
    _until(lambda: bool(worker.seqs))
    update = _update(session, d, 7)
    worker.gate.set()
    result, _ = update.future.result(10)
    assert result.ok and result.crossed == 1
    with pytest.raises(Aborted, match="version 7"):
        running.result(10)
    outs, v = _gen(d, 2).result(10)
    assert v == 7 and outs[0][2] == [[7, 0, 1]]
    d.stop()


def test_finish_policy_is_bounded_then_aborts_the_stragglers() -> None:
    worker, session, d = _engine(commit_wait_s=0.05)
    running = _gen(d, 1000)
    _until(lambda: bool(worker.seqs))
    worker.gate.set()
    result, _ = _update(session, d, 9).future.result(10)
    assert result.ok and result.crossed == 1 and result.drain_s >= 0.05
    with pytest.raises(Aborted, match="commit_wait_s"):
        running.result(10)
    d.stop()


def test_serving_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="crossing"):
        Serving(crossing="mixed")


def test_the_trainer_can_choose_the_policy_per_update() -> None:
    worker, session, d = _engine(crossing="finish")
    running = _gen(d, 1000)
    _until(lambda: bool(worker.seqs))
    worker.gate.set()
    result, _ = _update(session, d, 3, crossing="abort").future.result(10)
    assert result.ok and result.crossed == 1  # not after commit_wait_s (30 s): result(10) would time out
    with pytest.raises(Aborted, match="crossing policy 'abort'"):
        running.result(10)
    d.stop()


def test_each_engine_kind_maps_the_policy_onto_its_own_pause_or_refuses_it() -> None:
    from shardsync.config import ControlConfig
    from shardsync.control.sglang import SglangEngines
    from shardsync.control.vllm import VllmEngines

    assert VllmEngines.pause_mode_for(None) == "wait" and VllmEngines.pause_mode_for("abort") == "abort"
    with pytest.raises(ValueError, match="'keep' resumes running requests on KV caches"):
        VllmEngines.pause_mode_for("span")
    assert SglangEngines.pause_mode_for(None) == "abort" and SglangEngines.pause_mode_for("span") == "retract"
    with pytest.raises(ValueError, match="cannot wait for running requests"):
        SglangEngines.pause_mode_for("finish")
    with pytest.raises(ValueError, match="crossing must be one of"):
        ControlConfig(crossing="later")
    # an adapter sync reloads SGLang's adapter under a new id: a retracted request would keep the old one
    from shardsync.lora import Lora

    with pytest.raises(ValueError, match="use crossing='abort'"):
        SglangEngines(["http://127.0.0.1:1"], 1.0, "t" * 32, crossing="span", lora=Lora(8, 16.0))


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_the_scheduler_over_a_real_worker_generates_what_the_model_generates(tokens_per_step: int) -> None:
    """A real EngineWorker (tiny Qwen3, TP 1, in process): requests decoded step by step,
    interleaved, give exactly ``EngineModel.generate``'s tokens and logprobs."""
    from shardsync.engine.worker import EngineWorker
    from shardsync.models.engine import EngineModel
    from shardsync.models.weights import random_source
    from shardsync.presets import PRESETS

    spec = PRESETS["tiny-qwen3"]
    model = EngineModel.from_source(spec, random_source(spec, 3))
    d = Dispatcher(EngineWorker(model, 0, 1, secret="a-test-secret-0123456789"), [], None, UpdateSession(),
                   serving=Serving(tokens_per_step=tokens_per_step))
    d.start()
    bodies = [{"prompts": [[5, 6, 7], [8]], "max_new_tokens": 7, "temperature": 1.0, "top_p": 0.9, "seed": s,
               "stop_token_ids": []} for s in range(3)]
    futures = [d.submit(Op.GENERATE, b) for b in bodies]
    for b, f in zip(bodies, futures, strict=True):
        outs, version = f.result(60)
        assert [(t, lp) for t, lp, _ in outs] == model.generate(**b) and version == 0
        assert all(spans == [[0, 0, len(t) - 1]] for t, _, spans in outs)
    with pytest.raises(ValueError, match="engine command must be one of .*got 'nope'"):
        d.submit("nope", {})  # not a word: refused where commands enter, naming every choice
    with pytest.raises(ValueError, match="unknown engine command 'nope'"):
        d.worker.handle("nope", {})  # the worker refuses it by name too
    with pytest.raises(ValueError, match="unknown engine command 'staged'"):
        d.worker.handle(Op.STAGED, {})  # the dispatcher's own word, never a worker's
    d.stop()


def test_every_command_but_the_dispatchers_own_has_its_worker_method() -> None:
    from shardsync.engine.worker import COMMANDS

    assert set(COMMANDS) == set(Op) - {Op.STAGED}
    assert all(fn.__name__ == op.value for op, fn in COMMANDS.items())
