"""An engine's weight-update metrics as Prometheus collectors (``prometheus_client``): what an
operator graphs and alerts on - the p50/p99 of update time and of the engine's pause, by path;
bytes received; updates by outcome; the served version and whether it is stale.

Each engine session observes into one ``CollectorRegistry``: its own (the reference engine
serves it on ``/metrics``), or, for a rank hosted in vLLM or SGLang, the process's default one
(``process_metrics``): with ``PROMETHEUS_MULTIPROC_DIR`` set, as both engines set or honour it,
their own ``/metrics`` reads every process's values, so the same ``shardsync_*`` names appear
there.  Gauges are set, never computed at scrape, which multiprocess collection cannot do.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from shardsync.runtime.ledger import UpdateResult

# update and pause seconds: a colocated GPU update (~ms) to a slow full reload (minutes)
SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
           120.0, 300.0, 600.0)


class UpdateMetrics:
    """One engine's update collectors in ``registry`` (a fresh one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.seconds = Histogram("shardsync_update_seconds", "Seconds one weight update took on this engine "
                                 "(its slowest rank), by path", ["path"], buckets=SECONDS, registry=r)
        self.pause = Histogram("shardsync_update_pause_seconds", "Seconds this engine did not generate because "
                               "of one update, by path", ["path"], buckets=SECONDS, registry=r)
        self.phase = Histogram("shardsync_update_phase_seconds", "Seconds of each phase of one update on this "
                               "engine (pack, transfer, unpack, stage, drain, commit, pause, total)", ["phase"],
                               buckets=SECONDS, registry=r)
        self.bytes = Counter("shardsync_update_received_bytes", "Bytes this engine received for weight updates, "
                             "by path", ["path"], registry=r)
        self.updates = Counter("shardsync_updates", "Weight updates this engine settled, by path and outcome "
                               "(ok, failed)", ["path", "outcome"], registry=r)
        self.version = Gauge("shardsync_weight_version", "The weight version this engine serves", registry=r,
                             multiprocess_mode="livemax")
        self.stale = Gauge("shardsync_stale", "1 while this engine's weights are no version shardsync committed "
                           "(the next update is a full one; the reference engine refuses generation meanwhile)",
                           registry=r, multiprocess_mode="livemax")

    def state(self, version: int, stale: bool) -> None:
        self.version.set(version)
        self.stale.set(float(stale))

    def settled(self, result: UpdateResult) -> None:
        """One update's outcome; its seconds and bytes only when it committed."""
        path = result.mode.value
        self.updates.labels(path=path, outcome="ok" if result.ok else "failed").inc()
        if not result.ok:
            return
        self.seconds.labels(path=path).observe(result.total_s)
        self.pause.labels(path=path).observe(result.pause_s)
        self.bytes.labels(path=path).inc(result.bytes_received)
        for phase, seconds in result.phase_seconds().items():
            self.phase.labels(phase=phase).observe(seconds)


_PROCESS: UpdateMetrics | None = None


def process_metrics() -> UpdateMetrics:
    """This process's collectors in ``prometheus_client``'s default registry (created once: a
    name is registered there at most once)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = UpdateMetrics(REGISTRY)
    return _PROCESS
