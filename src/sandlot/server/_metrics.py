"""Prometheus metrics, one registry per app (no process globals, so tests can build many)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandlot import PoolStats

_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.sandboxes_live = Gauge(
            "sandlot_sandboxes_live", "Sandboxes alive on this server.", registry=self.registry
        )
        self.sandboxes_created = Counter(
            "sandlot_sandboxes_created", "Sandboxes started.", registry=self.registry
        )
        self.sandboxes_ended = Counter(
            "sandlot_sandboxes_ended",
            "Sandboxes ended, by reason (killed, expired, idle, server-shutdown).",
            ["reason"],
            registry=self.registry,
        )
        self.executions = Counter(
            "sandlot_executions",
            "Cells run, by outcome (ok, error, timeout, oom, killed).",
            ["outcome"],
            registry=self.registry,
        )
        self.execution_seconds = Histogram(
            "sandlot_execution_seconds",
            "Wall-clock duration of cells.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.sandbox_start_seconds = Histogram(
            "sandlot_sandbox_start_seconds",
            "Time to start a sandbox (request to ready).",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests_rejected = Counter(
            "sandlot_requests_rejected",
            "Requests refused, by reason (auth, quota, invalid, too_large).",
            ["reason"],
            registry=self.registry,
        )
        for outcome in ("ok", "error", "timeout", "oom", "killed"):
            self.executions.labels(outcome)

    def watch_calls(self, in_progress: Callable[[], int]) -> None:
        """Export the calls holding a sandbox (cells, commands, streams) right now, read
        when scraped: what a client that vanished mid-call would leave held."""
        self.registry.register(_CallsCollector(in_progress))

    def watch_pool(self, stats: Callable[[], PoolStats | None]) -> None:
        """Export the warm pool's counters, read when scraped."""
        self.registry.register(_PoolCollector(stats))


class _CallsCollector(Collector):
    def __init__(self, in_progress: Callable[[], int]) -> None:
        self._in_progress = in_progress

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "sandlot_sandbox_calls_in_progress",
            "Calls holding a sandbox now (cells, commands and their streams, file calls); "
            "a sandbox with none is idle to the reaper unless it runs a background process.",
            value=self._in_progress(),
        )


class _PoolCollector(Collector):
    def __init__(self, stats: Callable[[], PoolStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or PoolStats()
        requests = CounterMetricFamily(
            "sandlot_pool_requests",
            "Sandbox creates that asked the warm pool: served ready (hit) or started on the "
            "request (miss: nothing ready of that template and resources yet). Creates with "
            "a network policy, or on a server without a pool, start cold and are not counted.",
            labels=["result"],
        )
        requests.add_metric(["hit"], stats.hits)
        requests.add_metric(["miss"], stats.misses)
        yield requests
        yield GaugeMetricFamily(
            "sandlot_pool_ready", "Ready sandboxes in the warm pool.", value=stats.size
        )
