"""One update's ledger: each field's declared reduce over an engine's ranks, the wire's JSON
shape (other processes and users read it), and the update record's JSON line."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from pydantic import ValidationError

from shardsync.control.wire import Done
from shardsync.layout import EngineParallel, MegatronParallel
from shardsync.mode import Mode
from shardsync.presets import PRESETS
from shardsync.runtime.ledger import REDUCED, Cost, RankReport, Reduce, Served, UpdateResult
from shardsync.runtime.record import make_record
from shardsync.runtime.stats import Stats, StepTiming
from shardsync.topology import Topology
from shardsync.vocab import Staging

# the wire's keys, in order, as the engines, trainers and records.jsonl readers have them
RANK_KEYS = ["ok", "error", "pack_s", "transfer_s", "unpack_s", "derive_s", "total_s", "bytes_received", "changed",
             "derived_changed", "buffer_bytes", "buckets", "destination", "staging", "staging_bytes", "shard_bytes",
             "stage_s", "drain_s", "commit_s", "pause_s", "crossed"]
RESULT_KEYS = [*RANK_KEYS, "version", "mode"]
RECORD_KEYS = ["version", "mode", "fallback_reason", "ok", "rank", "bytes_sent", "buckets", "phases", "buffer_bytes",
               "link_bytes", "engines", "steps", "error", "delta", "source", "unsent_bytes",
               "started_at", "quantized_changed", "adapter"]


def _stats(scale: int = 1) -> Stats:
    return Stats(pack_s=0.25 * scale, transfer_s=0.5, unpack_s=0.125 * scale, bytes_sent=1000, bytes_received=4096,
                 changed=7, elements=9, peak_buffer_bytes=2048 * scale, buckets=3, encodings=Counter(dense=2),
                 steps=[StepTiming("a", "0->1", 10, 0.1)])


def _result(served: Served | None = None) -> UpdateResult:
    ranks = [RankReport.of(_stats(1), 0.0, "loader"), RankReport.of(_stats(2), 0.0, "params").model_dump()]
    return UpdateResult.of(3, Mode.P2P, ranks, served=served)


def test_every_cost_field_declares_its_reduce() -> None:
    assert set(REDUCED) | {"ok", "error"} == set(Cost.model_fields)
    assert (REDUCED["total_s"], REDUCED["bytes_received"], REDUCED["destination"]) == (Reduce.MAX, Reduce.SUM,
                                                                                       Reduce.FIRST)
    assert set(UpdateResult.model_fields) == set(Cost.model_fields) | set(Served.model_fields) | {"version", "mode"}


def test_ranks_reduce_as_each_field_declares() -> None:
    res = _result()
    assert res.ok and res.error is None and (res.version, res.mode) == (3, Mode.P2P)
    assert (res.pack_s, res.unpack_s, res.transfer_s) == (0.5, 0.25, 0.5)  # Reduce.MAX: the slowest rank
    assert res.total_s > 0
    assert (res.bytes_received, res.changed, res.buckets) == (8192, 14, 6)  # Reduce.SUM
    assert res.buffer_bytes == 4096  # Reduce.MAX
    assert res.destination == "loader"  # Reduce.FIRST
    assert res.staging is Staging.IN_PLACE and res.pause_s == 0.0  # nobody served: the defaults


def test_the_engine_sets_its_serving_facts_whole() -> None:
    served = Served(staging=Staging.SWAP, staging_bytes=100, shard_bytes=400, stage_s=0.5, commit_s=0.01,
                    pause_s=0.02, drain_s=0.003, crossed=2)
    res = _result(served)
    assert res.model_dump(include=set(Served.model_fields)) == served.model_dump()
    assert res.bytes_received == 8192


def test_a_failed_rank_fails_the_engine_and_its_numbers_count_for_none() -> None:
    ranks = [RankReport.of(_stats(), 0.0, "params"), RankReport(ok=False, error="boom"), RankReport(ok=False)]
    res = UpdateResult.of(4, Mode.BROADCAST, ranks, served=Served(pause_s=0.5))
    assert not res.ok and res.error == "boom"
    assert (res.bytes_received, res.pack_s, res.destination, res.pause_s) == (0, 0.0, "params", 0.5)
    assert UpdateResult.of(4, Mode.BROADCAST, [RankReport(ok=False)]).error == "rank 0 failed"
    assert UpdateResult.of(4, Mode.BROADCAST, ranks[:1], error="worker died").error == "worker died"
    assert UpdateResult.of(4, Mode.BROADCAST, []).ok  # an engine with no rank reports is no failure


def test_the_wire_shape_is_kept() -> None:
    rank = RankReport.of(_stats(), 0.0, "params")
    assert list(json.loads(rank.model_dump_json())) == RANK_KEYS
    res = _result()
    assert list(json.loads(res.model_dump_json())) == RESULT_KEYS
    assert json.loads(Done(engines=[res]).model_dump_json())["engines"][0]["mode"] == "p2p"
    assert UpdateResult.model_validate_json(res.model_dump_json()) == res
    with pytest.raises(ValidationError):  # other processes' values: nothing unknown, nothing infinite
        RankReport.model_validate({"ok": True, "surprise": 1})
    with pytest.raises(ValidationError):
        RankReport.model_validate_json('{"total_s": Infinity}')


def test_phases_are_the_ledgers_seconds_in_order() -> None:
    res = _result(Served(pause_s=0.02))
    assert UpdateResult.phases() == ("pack_s", "transfer_s", "unpack_s", "derive_s", "total_s", "stage_s",
                                     "drain_s", "commit_s", "pause_s")
    seconds = res.phase_seconds()
    assert list(seconds) == ["pack", "transfer", "unpack", "derive", "total", "stage", "drain", "commit", "pause"]
    assert (seconds["pack"], seconds["pause"]) == (0.5, 0.02)


@pytest.mark.parametrize("mode", [Mode.P2P, Mode.DELTA_P2P])
def test_a_record_keeps_its_json_line_and_round_trips(mode: Mode) -> None:
    topo = Topology(PRESETS["tiny-llama"], MegatronParallel(tp=2), (EngineParallel(tp=2),) * 2)
    window = Served(staging=Staging.SWAP, staging_bytes=100, shard_bytes=400, stage_s=0.5, commit_s=0.01,
                    pause_s=0.02)
    engines = [_result(), _result(window)]
    rec = make_record(3, mode, None, _stats(), engines, {"plan": 0.001, "control": 0.002, "total": 1.5}, rank=0,
                      topo=topo, detail=True, fallback_reason=None, buckets=3)
    assert rec.engines == engines  # typed, not copied field by field
    line = json.loads(rec.to_json())
    assert list(line) == RECORD_KEYS
    assert [list(e) for e in line["engines"]] == [RESULT_KEYS, RESULT_KEYS]
    assert line["engines"][1]["staging"] == "swap" and line["engines"][0]["mode"] == "p2p"
    assert [UpdateResult.model_validate(e) for e in line["engines"]] == engines
    assert rec.engines_json() == line["engines"]
    assert rec.pause_s == 0.02
    assert rec.summary().endswith(" engine_pause=20.00ms (staged 500.0ms, commit 10.00ms, window 25% of the shard)")
    if mode.is_delta:
        assert line["delta"]["engine_changed"] == 28 and line["delta"]["engine_bytes_received"] == 2 * 8192
