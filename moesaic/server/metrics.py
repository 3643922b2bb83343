"""/metrics: Prometheus text (prometheus-client), one registry per app.

Per request (counted when it ends): requests by finish reason, prompt and generated tokens, time to first
token, time per output token and end-to-end latency histograms. Read from the engine when scraped:
running and waiting requests, cache blocks (used, free, total), prefix-cache hits, preemptions and the
snapshot store, and speculative decoding's counters when it is on. Names follow vLLM's (`vllm:...`) under the `moesaic_` prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class Metrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine  # the AsyncEngine
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.labels = labels
        r = self.registry
        self.requests = Counter(
            "moesaic_request_success",
            "Requests ended, by finish reason",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "moesaic_prompt_tokens", "Prompt tokens of ended requests", ["model_name"], registry=r
        )
        self.generation_tokens = Counter(
            "moesaic_generation_tokens", "Tokens generated", ["model_name"], registry=r
        )
        self.ttft = Histogram(
            "moesaic_time_to_first_token_seconds",
            "Time to first token",
            ["model_name"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "moesaic_time_per_output_token_seconds",
            "Time per output token after the first",
            ["model_name"],
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "moesaic_e2e_request_latency_seconds",
            "Request latency",
            ["model_name"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(self))

    def request_done(
        self, reason: str, prompt_tokens: int, completion_tokens: int, start, first, end
    ) -> None:
        m = self.labels["model_name"]
        self.requests.labels(m, reason).inc()
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(completion_tokens)
        self.e2e.labels(m).observe(end - start)
        if first is not None:
            self.ttft.labels(m).observe(first - start)
            if completion_tokens > 1:
                self.tpot.labels(m).observe((end - first) / (completion_tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's own counters, read at scrape time."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        s = self.metrics.engine.stats()
        name = [self.metrics.labels["model_name"]]

        def gauge(key, doc, value):
            g = GaugeMetricFamily(f"moesaic_{key}", doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(key, doc, value):
            c = CounterMetricFamily(f"moesaic_{key}", doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        req, blocks = s["requests"], s["blocks"]
        yield gauge("num_requests_running", "Sequences running in the engine", req["running"])
        yield gauge("num_requests_waiting", "Sequences waiting in the engine", req["waiting"])
        yield gauge("num_requests_active", "Requests the server has in flight", s["async"]["active_requests"])
        yield gauge("cache_blocks_used", "Cache blocks held by sequences", blocks["used"])
        yield gauge("cache_blocks_free", "Cache blocks free (cached prefixes included)", blocks["free"])
        yield gauge("cache_blocks_total", "Cache blocks in the pool", blocks["total"])
        yield gauge("cache_blocks_cached", "Free blocks that hold a cached prefix", blocks["cached"])
        yield gauge(
            "cache_usage_perc", "Fraction of cache blocks in use", blocks["used"] / max(1, blocks["total"])
        )
        yield gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens served by the prefix cache / admitted",
            s["prefix_hit_rate"],
        )
        yield counter(
            "prefix_cache_hits", "Prompt tokens served by the prefix cache", s["cached_prompt_tokens"]
        )
        yield counter("num_preemptions", "Preemptions by recompute", s["preemptions"])
        yield gauge(
            "snapshot_bytes", "Bytes of recurrent-state snapshots kept for prefix reuse", s["snapshot_bytes"]
        )
        yield counter("engine_loop_errors", "Engine steps that failed", s["async"]["loop_errors"])
        spec = s.get("speculative")
        if spec is not None:  # vLLM's spec_decode_* names
            yield counter(
                "spec_decode_num_drafts", "Verify rounds (one per drafting sequence)", spec["rounds"]
            )
            yield counter("spec_decode_num_draft_tokens", "Draft tokens proposed", spec["drafted"])
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted", spec["accepted"])
            yield counter(
                "spec_decode_target_forwards", "Target forwards (every step)", spec["target_forwards"]
            )
            yield gauge(
                "spec_decode_mean_accepted_length", "Tokens committed per verify round (tau)", spec["tau"]
            )
            yield counter(
                "spec_decode_gated_steps",
                "Decode steps adaptive drafting held off (plain steps measured faster)",
                spec["gated_steps"],
            )
            per = CounterMetricFamily(
                "moesaic_spec_decode_num_accepted_tokens_per_pos",
                "Draft tokens accepted at each draft position",
                labels=["model_name", "position"],
            )
            for i, n in enumerate(spec["per_position_accepted"]):
                per.add_metric([name[0], str(i)], n)
            yield per
