"""The reference engine's serving metrics (requests, tokens, generation seconds), beside its
update metrics in one Prometheus registry: weights changing under load shows next to the
load itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from shardsync.control.metrics import SECONDS


class ServingMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("shardsync_generate_requests", "Generate requests answered", registry=registry)
        self.tokens = Counter("shardsync_generated_tokens", "Tokens generated", registry=registry)
        self.seconds = Histogram("shardsync_generate_seconds", "Seconds one generate request took",
                                 buckets=SECONDS, registry=registry)
        self.spanning = Counter("shardsync_generate_spanning", "Generate requests whose tokens span more than "
                                "one weight version (crossing=span)", registry=registry)
        self.logprobs = Counter("shardsync_logprobs_requests", "Logprobs requests answered", registry=registry)

    def generated(self, seconds: float, tokens: int, *, spanning: bool) -> None:
        self.requests.inc()
        self.tokens.inc(tokens)
        self.seconds.observe(seconds)
        if spanning:
            self.spanning.inc()
