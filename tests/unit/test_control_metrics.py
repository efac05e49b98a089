"""An engine session's Prometheus collectors (``control/metrics.py``), read back through
``prometheus_client``'s own text parser: histograms count every committed update by path, a
failed one counts as failed only, and the gauges read the session when scraped."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shardsync.control.session import State, UpdateSession
from shardsync.mode import Mode
from shardsync.runtime.ledger import UpdateResult


def _scrape(s: UpdateSession) -> dict[str, dict]:
    """Every sample, by metric family name then (sample name, sorted labels)."""
    text = generate_latest(s.metrics.registry).decode()
    return {f.name: {(x.name, tuple(sorted(x.labels.items()))): x.value for x in f.samples}
            for f in text_string_to_metric_families(text)}


def _settle(s: UpdateSession, version: int, mode: str, *, ok: bool = True, total_s: float = 0.02) -> None:
    s.state = State.RECEIVING
    s.settle(UpdateResult(version=version, mode=Mode(mode), ok=ok, error=None if ok else "boom", total_s=total_s,
                          pause_s=total_s / 2, bytes_received=1000, transfer_s=total_s / 4))


def test_histograms_count_committed_updates_by_path_and_failures_apart() -> None:
    s = UpdateSession()
    for v in range(1, 4):
        _settle(s, v, "p2p")
    _settle(s, 4, "broadcast", total_s=3.0)
    _settle(s, 5, "p2p", ok=False)
    m = _scrape(s)
    seconds = m["shardsync_update_seconds"]
    assert seconds[("shardsync_update_seconds_count", (("path", "p2p"),))] == 3
    assert seconds[("shardsync_update_seconds_count", (("path", "broadcast"),))] == 1
    assert seconds[("shardsync_update_seconds_bucket", (("le", "0.025"), ("path", "p2p")))] == 3
    assert seconds[("shardsync_update_seconds_bucket", (("le", "2.5"), ("path", "broadcast")))] == 0
    assert m["shardsync_update_pause_seconds"][("shardsync_update_pause_seconds_sum", (("path", "p2p"),))] == 0.03
    updates = m["shardsync_updates"]
    assert updates[("shardsync_updates_total", (("outcome", "ok"), ("path", "p2p")))] == 3
    assert updates[("shardsync_updates_total", (("outcome", "failed"), ("path", "p2p")))] == 1
    assert m["shardsync_update_received_bytes"][("shardsync_update_received_bytes_total", (("path", "p2p"),))] == 3000
    phases = {labels[0][1] for (name, labels) in m["shardsync_update_phase_seconds"] if name.endswith("_count")}
    assert {"transfer", "pause", "total", "commit"} <= phases
    assert m["shardsync_weight_version"][("shardsync_weight_version", ())] == 4  # read when scraped
    assert m["shardsync_stale"][("shardsync_stale", ())] == 1  # the failed update left it stale


def test_every_family_says_what_it_is() -> None:
    text = generate_latest(UpdateSession().metrics.registry).decode()
    families = list(text_string_to_metric_families(text))
    assert families and all(f.documentation for f in families)
    assert all(f.name.startswith("shardsync_") for f in families)
