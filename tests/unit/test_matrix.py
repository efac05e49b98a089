"""The fallback matrix: deterministic, generated from the precondition table, faithful to
``WeightSync``'s mode choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardsync.paths import choose_full
from shardsync.plan.matrix import MODES, build, decide, render_markdown
from shardsync.plan.preconditions import PRECONDITIONS
from shardsync.presets import PRESETS

DOC = Path(__file__).resolve().parents[2] / "docs" / "fallback_matrix.md"
# Cannot fail on a topology that exists: ModelSpec refuses other families, and the planner
# covers every engine element once both layouts build (checked below, not assumed).
UNCONSTRUCTIBLE = {"model_family", "plan_covers"}


@pytest.fixture(scope="module")
def entries():
    return build()


def test_render_is_deterministic_and_matches_the_doc(entries) -> None:
    text = render_markdown(entries)
    assert text == render_markdown(build())
    assert DOC.read_text() == text, "docs/fallback_matrix.md is stale: run shardsync plan --matrix"


def test_every_constructible_precondition_fails_somewhere(entries) -> None:
    first = {e.first_failure.name for e in entries if e.first_failure is not None}
    assert first == {p.name for p in PRECONDITIONS} - UNCONSTRUCTIBLE
    # ... and as the reason of a fallback, not only behind an impossible deployment.
    fallback = {e.first_failure.name for e in entries
                if e.first_failure is not None and e.impossible is None}
    assert fallback >= {"engine_layout_known", "engine_pp_1", "quantization", "vllm_vocab_split", "vllm_experts"}


def test_unconstructible_preconditions_really_are(entries) -> None:
    with pytest.raises(ValueError, match="unknown model family"):
        PRESETS["tiny-qwen3"].replace(family="mixtral")
    for e in entries:
        if e.impossible is None:
            covers = next(v for v in e.verdicts if v.name == "plan_covers")
            assert covers.ok or covers.detail.startswith("not checked"), (e.case, covers)


def test_p2p_implies_every_precondition_holds(entries) -> None:
    for e in entries:
        for d in e.decisions:
            if d.path == "p2p":
                assert all(v.ok for v in e.verdicts), (e.case, d)
        assert (e.decisions[0].path == "p2p") == all(v.ok for v in e.verdicts), e.case


def test_mode_semantics(entries) -> None:
    paths = {m: {d.path for e in entries for d in e.decisions if d.mode == m} for m in MODES}
    assert paths == {"auto": {"p2p", "broadcast", "refused"}, "p2p": {"p2p", "refused"},
                     "broadcast": {"broadcast", "refused"}}
    for e in entries:
        auto, p2p, bcast = e.decisions
        if e.impossible is not None:
            assert {auto.path, p2p.path, bcast.path} == {"refused"}
            assert e.impossible.name in auto.why
            continue
        assert bcast.path == "broadcast" and bcast.why == ""
        if e.first_failure is not None:
            assert auto.path == "broadcast" and e.first_failure.name in auto.why
            assert p2p.path == "refused" and p2p.why.startswith("ValueError: mode='p2p'")


def test_decisions_match_choose_full(entries) -> None:
    """The matrix mirrors paths.choose_full, which WeightSync uses (same path, same reason text)."""
    for e in entries:
        if e.impossible is not None:
            continue
        topo = e.case.topology()
        for mode in MODES:
            ours = decide(e, mode)
            try:
                path, reason = choose_full(topo, mode)
            except ValueError as err:
                assert ours.path == "refused" and ours.why == f"ValueError: {err}", e.case
                continue
            assert ours.path == path, (e.case, mode)
            assert ours.why == (reason or ""), (e.case, mode)
