"""Prometheus metrics of a worker (`rollout-worker --metrics-port PORT`, then scrape http://HOST:PORT/metrics).

Every counter and gauge is read from `RolloutWorker.stats()` at scrape time, so the `stats` message, `RolloutClient.
stats()` and /metrics always agree; only the engine step time is observed as it happens (a histogram). Rates such
as tokens per second come from Prometheus: `rate(rollout_generated_tokens_total[1m])`.

| metric                                      | kind      | from stats()                                          |
|---------------------------------------------|-----------|-------------------------------------------------------|
| rollout_groups_received_total               | counter   | groups_received (generate requests accepted)          |
| rollout_groups_refused_total                | counter   | groups_refused (answered with an error)               |
| rollout_groups_finished_total               | counter   | groups_finished                                       |
| rollout_samples_finished_total{reason}      | counter   | samples_finished (stop, length, abort, error)         |
| rollout_generated_tokens_total              | counter   | generated_tokens                                      |
| rollout_prefill_tokens_total                | counter   | prefill_tokens (prompt and recompute chunks)          |
| rollout_prefix_cache_hit_ratio              | gauge     | prefix_cache_hit_tokens / prefix_cache_query_tokens   |
| rollout_preemptions_total{kind}             | counter   | preemptions, preemptions_swapped (kind swap/recompute)|
| rollout_draft_tokens_total{outcome}         | counter   | accepted_draft_tokens, draft_tokens (accepted/rejected)|
| rollout_queue_depth                         | gauge     | queued                                                |
| rollout_running_samples                     | gauge     | running                                               |
| rollout_groups_in_flight                    | gauge     | groups_in_flight                                      |
| rollout_kv_blocks{state}                    | gauge     | kv_blocks_used, kv_blocks_free (state used/free)      |
| rollout_clients                             | gauge     | clients                                               |
| rollout_clients_lost_total                  | counter   | clients_lost                                          |
| rollout_pending_reply_bytes                 | gauge     | pending_reply_bytes                                   |
| rollout_policy_version                      | gauge     | policy_version                                        |
| rollout_generation_paused                   | gauge     | generation_paused (1 from POST /pause until /resume)  |
| rollout_weight_updates_total                | counter   | weight_updates                                        |
| rollout_weight_updates_rejected_total       | counter   | weight_updates_rejected                               |
| rollout_weight_update_bytes_total           | counter   | weight_update_bytes                                   |
| rollout_weight_update_pause_seconds_total   | counter   | weight_update_pause_ms / 1000                         |
| rollout_step_seconds                        | histogram | (observed on the engine thread)                       |
| rollout_http_requests_total{endpoint,status}| counter   | (observed by the HTTP front end, with --http)         |
| rollout_http_request_seconds{endpoint}      | histogram | (to the end of the answer: a stream's last event)     |

Groups count alike whichever door they came through: a /v1/completions request with 3 prompts is 3 groups.
`endpoint` is the path (/v1/completions, /v1/chat/completions, /tokenize, ...) or "other" for any path the API does
not serve (a bounded set of labels, whatever paths clients send).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rollout.service.observability.metrics_server import MetricsServer

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HTTP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _StatsCollector:
    """Turns one stats() snapshot into metric families, at every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self):
        stats = self._stats()

        def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"rollout_{name}", documentation, value=value)

        def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"rollout_{name}", documentation, value=value)

        yield counter("groups_received", "Generate requests accepted", stats["groups_received"])
        yield counter("groups_refused", "Generate requests answered with an error", stats["groups_refused"])
        yield counter("groups_finished", "Groups whose every sample finished", stats["groups_finished"])
        finished = CounterMetricFamily("rollout_samples_finished", "Samples finished, by reason", labels=["reason"])
        for reason, count in sorted(stats["samples_finished"].items()):
            finished.add_metric([reason], count)
        yield finished
        yield counter("generated_tokens", "Tokens sampled", stats["generated_tokens"])
        yield counter("prefill_tokens", "Tokens computed in prompt (or recompute) chunks", stats["prefill_tokens"])
        queried = stats["prefix_cache_query_tokens"]
        hit_ratio = stats["prefix_cache_hit_tokens"] / queried if queried else 0.0
        yield gauge("prefix_cache_hit_ratio", "Admitted tokens found in the prefix cache", hit_ratio)
        preemptions = CounterMetricFamily("rollout_preemptions", "Preempted requests, by kind", labels=["kind"])
        preemptions.add_metric(["swap"], stats["preemptions_swapped"])
        preemptions.add_metric(["recompute"], stats["preemptions"] - stats["preemptions_swapped"])
        yield preemptions
        drafts = CounterMetricFamily("rollout_draft_tokens", "Draft tokens verified, by outcome", labels=["outcome"])
        drafts.add_metric(["accepted"], stats["accepted_draft_tokens"])
        drafts.add_metric(["rejected"], stats["draft_tokens"] - stats["accepted_draft_tokens"])
        yield drafts
        yield gauge("queue_depth", "Requests waiting for admission", stats["queued"])
        yield gauge("running_samples", "Samples running in the engine", stats["running"])
        yield gauge("groups_in_flight", "Groups accepted and not finished", stats["groups_in_flight"])
        blocks = GaugeMetricFamily("rollout_kv_blocks", "KV cache blocks, by state", labels=["state"])
        blocks.add_metric(["used"], stats["kv_blocks_used"])
        blocks.add_metric(["free"], stats["kv_blocks_free"])
        yield blocks
        yield gauge("clients", "Clients with groups in flight, an open update or replies waiting", stats["clients"])
        yield counter("clients_lost", "Clients found gone (closed, not reading or silent)", stats["clients_lost"])
        yield gauge("pending_reply_bytes", "Reply bytes waiting for slow clients", stats["pending_reply_bytes"])
        yield gauge("policy_version", "Version of the weights being served", stats["policy_version"])
        yield gauge(
            "generation_paused", "1 while generation is paused (POST /pause until /resume)", stats["generation_paused"]
        )
        yield counter("weight_updates", "Weight updates committed", stats["weight_updates"])
        yield counter("weight_updates_rejected", "Weight updates refused or dropped", stats["weight_updates_rejected"])
        yield counter("weight_update_bytes", "Bytes of committed weight updates", stats["weight_update_bytes"])
        yield counter(
            "weight_update_pause_seconds", "Engine pause for weight updates", stats["weight_update_pause_ms"] / 1e3
        )


class WorkerMetrics:
    """The metrics of one worker, in a registry of its own (several workers may live in one process)."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        """
        Args:
            stats: the worker's `stats` method (called from the scraping thread).
        """
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats))
        self.step_seconds = Histogram(
            "rollout_step_seconds", "Wall time of one engine step", buckets=STEP_BUCKETS, registry=self.registry
        )
        self.http_requests = Counter(
            "rollout_http_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.http_request_seconds = Histogram(
            "rollout_http_request_seconds",
            "HTTP request time to the end of its answer",
            ["endpoint"],
            buckets=HTTP_BUCKETS,
            registry=self.registry,
        )
        self._server: MetricsServer | None = None

    def observe_step(self, seconds: float) -> None:
        """Record one engine step (engine thread)."""
        self.step_seconds.observe(seconds)

    def observe_http(self, endpoint: str, status: int, seconds: float) -> None:
        """Record one HTTP request answered (the HTTP front end's thread).

        Args:
            endpoint: its path, or "other".
            status: the HTTP status it was answered with.
            seconds: from its arrival to the end of its answer.
        """
        self.http_requests.labels(endpoint, str(status)).inc()
        self.http_request_seconds.labels(endpoint).observe(seconds)

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics over HTTP on a thread of its own (only to loopback Host headers when `host` is loopback);
        returns the port (0 picks a free one).

        Raises:
            OSError: it cannot listen there.
        """
        self._server = MetricsServer(self.registry, port, host)
        return self._server.port

    def close(self) -> None:
        """Stop the HTTP server."""
        if self._server is not None:
            self._server.close()
            self._server = None
