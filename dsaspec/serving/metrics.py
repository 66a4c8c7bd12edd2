"""The server's Prometheus metrics (``/metrics``), in a registry of their own."""

from __future__ import annotations

# seconds: sub-millisecond CPU steps up to long prefills
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 30.0)


class ServerMetrics:
    """Gauges of the scheduler (running and waiting requests, the last decode step's batch, KV
    pages in use and in all, the mean accept length since start), histograms of time to first
    token, time per output token (per request) and inter-token latency (per step that gives a
    request tokens), and counters of requests by finish reason, of tokens and of the seconds the
    engine spent prefilling (every running request waits for them)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.running = Gauge("dsaspec_num_running_requests", "Requests in the running batch", registry=r)
        self.waiting = Gauge("dsaspec_num_waiting_requests", "Requests waiting for a row and KV pages", registry=r)
        self.batch = Gauge("dsaspec_batch_size", "Requests in the last decode step", registry=r)
        self.kv_used = Gauge("dsaspec_kv_pages_used", "KV pages reserved by admitted requests", registry=r)
        self.kv_total = Gauge("dsaspec_kv_pages_total", "KV pages of the pool (the reserved page excluded)",
                              registry=r)
        self.accept = Gauge("dsaspec_mean_accept_length", "Mean tokens committed per request per decode step "
                            "since start (1 without speculation)", registry=r)
        self.ttft = Histogram("dsaspec_time_to_first_token_seconds", "Submission to first token", buckets=_LATENCY,
                              registry=r)
        self.tpot = Histogram("dsaspec_time_per_output_token_seconds", "Mean time between a request's tokens after "
                              "the first", buckets=_LATENCY, registry=r)
        self.itl = Histogram("dsaspec_inter_token_latency_seconds", "Time between two steps that give a request "
                             "tokens", buckets=_LATENCY, registry=r)
        self.requests = Counter("dsaspec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("dsaspec_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("dsaspec_generation_tokens", "Tokens generated", registry=r)
        self.prefill_seconds = Counter("dsaspec_prefill_seconds", "Seconds spent admitting (prefilling) requests "
                                       "between decode steps", registry=r)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text of every metric and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
