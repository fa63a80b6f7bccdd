"""The server's own collectors (beside the cache's, in a registry of their own; `/metrics`
serves both). Listed in docs/configuration.md ("Metrics").

| metric                              | type      | labels            |
|-------------------------------------|-----------|-------------------|
| ragcache_serve_requests             | counter   | route, status     |
| ragcache_serve_uncached             | counter   | reason            |
| ragcache_serve_disconnects          | counter   | route             |
| ragcache_serve_request_seconds      | histogram | route             |
| ragcache_serve_in_flight            | gauge     |                   |
| ragcache_serve_waiting              | gauge     |                   |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ragcache_core.serve.queue import BoundedQueue

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServeMetrics:
    """Requests by route and status, uncached requests by reason, disconnects, request time;
    the bounded queue's occupancy is read at scrape time."""

    def __init__(self, queue: BoundedQueue) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "ragcache_serve_requests", "HTTP requests answered", ["route", "status"], registry=r
        )
        self.uncached = Counter(
            "ragcache_serve_uncached", "Requests served without the cache", ["reason"], registry=r
        )
        self.disconnects = Counter(
            "ragcache_serve_disconnects", "Clients gone before the end", ["route"], registry=r
        )
        self.seconds = Histogram(
            "ragcache_serve_request_seconds",
            "Time from request to the end of its response",
            ["route"],
            buckets=_SECONDS,
            registry=r,
        )
        in_flight = Gauge("ragcache_serve_in_flight", "Requests in flight", registry=r)
        in_flight.set_function(lambda: queue.in_flight)
        waiting = Gauge("ragcache_serve_waiting", "In flight beyond max_num_seqs", registry=r)
        waiting.set_function(lambda: queue.waiting)

    def answered(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.seconds.labels(route).observe(seconds)
