"""Conductor metrics, named after vLLM's under our own prefix."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120)
_TBT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1, 2.5)


class ConductorMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        p = "mooncaked"
        self.requests = Counter(f"{p}_requests", "Finished requests by status", ["status"],
                                registry=registry)
        self.rejections = Counter(f"{p}_rejections", "Requests rejected early, by reason",
                                  ["reason"], registry=registry)
        self.ttft = Histogram(f"{p}:time_to_first_token_seconds", "TTFT", buckets=_LATENCY_BUCKETS,
                              registry=registry)
        self.tbt = Histogram(f"{p}:time_per_output_token_seconds", "Token intervals",
                             buckets=_TBT_BUCKETS, registry=registry)
        self.e2e = Histogram(f"{p}:e2e_request_latency_seconds", "End-to-end latency",
                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram(f"{p}:request_queue_time_seconds", "Time queued at the prefill node",
                               buckets=_LATENCY_BUCKETS, registry=registry)
        self.prefix_queries = Counter(f"{p}:prefix_cache_queries", "Prompt tokens looked up",
                                      registry=registry)
        self.prefix_hits = Counter(f"{p}:prefix_cache_hits", "Prompt tokens reused (local or fetched)",
                                   registry=registry)
        self.fetched = Counter(f"{p}:prefix_cache_fetched_tokens", "Reused tokens fetched from a peer",
                               registry=registry)
        self.transfer = Counter(f"{p}:kv_transfer_bytes", "Prefix KV bytes moved between prefill nodes",
                                registry=registry)
        self.prompt_tokens = Counter(f"{p}:prompt_tokens", "Prompt tokens", registry=registry)
        self.generation_tokens = Counter(f"{p}:generation_tokens", "Generated tokens", registry=registry)
        self.running = Gauge(f"{p}:num_requests_running", "Requests in flight", registry=registry)
        # Predicted vs actual, per request: what the scheduler's early
        # rejection stands on (predicted TBT: the decode step at the load when
        # the request joins; actual: mean interval between its decoded tokens).
        self.predicted_ttft = Histogram(f"{p}:predicted_time_to_first_token_seconds",
                                        "Scheduler-predicted TTFT of requests that got a first token",
                                        buckets=_LATENCY_BUCKETS, registry=registry)
        self.ttft_error = Histogram(f"{p}:ttft_prediction_abs_error_seconds",
                                    "|predicted - actual| TTFT per request",
                                    buckets=_LATENCY_BUCKETS, registry=registry)
        self.predicted_tbt = Histogram(f"{p}:predicted_time_per_output_token_seconds",
                                       "Scheduler-predicted TBT of requests that decoded",
                                       buckets=_TBT_BUCKETS, registry=registry)
        self.request_tbt = Histogram(f"{p}:request_time_per_output_token_seconds",
                                     "Measured TBT per request (mean decoded-token interval)",
                                     buckets=_TBT_BUCKETS, registry=registry)
        self.tbt_error = Histogram(f"{p}:tbt_prediction_abs_error_seconds",
                                   "|predicted - actual| TBT per request",
                                   buckets=_TBT_BUCKETS, registry=registry)
        # Requests the conductor proxied to external engines (conductor.engines),
        # by engine and outcome: the fleet's share of the work at a glance.
        self.engine_requests = Counter(f"{p}_engine_requests", "Requests proxied to an engine, "
                                       "by engine and status", ["engine", "status"],
                                       registry=registry)

    def rejected(self, reason: str) -> None:
        self.rejections.labels(reason).inc()

    def first_token(self, trace) -> None:
        self.ttft.observe(trace.ttft_s)
        self.predicted_ttft.observe(trace.predicted_ttft_s)
        self.ttft_error.observe(abs(trace.predicted_ttft_s - trace.ttft_s))
        self.queue.observe(trace.prefill_queue_s)
        self.prefix_queries.inc(trace.prompt_tokens)
        self.prefix_hits.inc(trace.cached_tokens)
        self.fetched.inc(trace.fetched_tokens)
        self.prompt_tokens.inc(trace.prompt_tokens)

    def transfer_bytes(self, nbytes: int) -> None:
        self.transfer.inc(nbytes)

    def finished(self, trace) -> None:
        self.requests.labels(trace.status.split()[0]).inc()
        self.e2e.observe(trace.e2e_s)
        self.generation_tokens.inc(len(trace.token_times))
        times = trace.token_times
        for a, b in zip(times, times[1:]):
            self.tbt.observe(b - a)
        if len(times) > 1 and trace.status == "ok":
            self.predicted_tbt.observe(trace.predicted_tbt_s)
            self.request_tbt.observe(trace.tbt_s)
            self.tbt_error.observe(abs(trace.predicted_tbt_s - trace.tbt_s))


    def engine_first_token(self, ttft_s: float | None, predicted_ttft_s: float,
                           prompt_tokens: int, cached_tokens: int) -> None:
        """A proxied request's first token (the engines' side of first_token);
        ``ttft_s`` None: a whole answer, whose first token the conductor
        never sees, counts its prompt only."""
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            self.predicted_ttft.observe(predicted_ttft_s)
            self.ttft_error.observe(abs(predicted_ttft_s - ttft_s))
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)

    def engine_finished(self, engine: str, status: str, e2e_s: float, tokens: int) -> None:
        self.requests.labels(status).inc()
        self.engine_requests.labels(engine, status).inc()
        self.e2e.observe(e2e_s)
        self.generation_tokens.inc(tokens)


class NodeLoadCollector(Collector):
    """Per-node load as the scheduler sees it, read at scrape time."""

    def __init__(self, status: Callable[[], dict]) -> None:
        self.status = status

    def collect(self) -> Iterator[GaugeMetricFamily]:
        st = self.status()
        queue = GaugeMetricFamily("mooncaked_prefill_queue_seconds",
                                  "Predicted queued prefill time per prefill instance", labels=["node"])
        cached = GaugeMetricFamily("mooncaked_prefill_cached_blocks",
                                   "Blocks the global index holds per prefill instance", labels=["node"])
        batch = GaugeMetricFamily("mooncaked_decode_batch_size", "Running sequences per decode node",
                                  labels=["node"])
        pages = GaugeMetricFamily("mooncaked_decode_free_pages", "Free KV pages per decode node",
                                  labels=["node"])
        for node, p in st["prefill"].items():
            if p["alive"]:
                queue.add_metric([node], p["queue_s"])
                cached.add_metric([node], p["cached_blocks"])
        for node, d in st["decode"].items():
            if d["alive"]:
                batch.add_metric([node], d["batch_size"])
                pages.add_metric([node], d["free_pages"])
        error = st.get("ttft_error_mean_s")
        err = GaugeMetricFamily("mooncaked_ttft_prediction_error_seconds",
                                "Mean predicted minus actual TTFT over recent requests")
        err.add_metric([], error if error is not None else 0.0)
        yield from (queue, cached, batch, pages, err)
