"""Prometheus metrics of one node's training, served by its agent (``--diag-metrics``).

The diagnostics monitor already reads every step mark and every timed collective from the
workers' rings; :class:`DiagMetrics` turns what it reads into Prometheus series:

* ``elasticft_step_seconds`` (histogram, per rank): wall time between two optimizer steps;
* ``elasticft_collective_seconds`` (histogram): duration of each timed collective / DDP bucket;
* ``elasticft_collective_latency_seconds{quantile}``: p50/p90/p99 of the recent collective
  durations the hang detector learns from, computed when scraped;
* ``elasticft_detections_total{detector}``: detection events raised by this node;
* ``elasticft_worker_restarts``, ``elasticft_rendezvous_round``, ``elasticft_workers``: the
  group as of its latest start; ``elasticft_last_step{rank}``: each rank's latest step number.

Every agent owns its :class:`~prometheus_client.CollectorRegistry` (no process-global registry,
so tests and several agents in one process do not mix series). The HTTP endpoint binds the
address it is given (loopback by default) and, when a token is configured, answers only requests
carrying ``Authorization: Bearer <token>`` (Prometheus' ``authorization`` scrape setting).
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

logger = logging.getLogger(__name__)

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
COLLECTIVE_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                      2.5, 5.0, 10.0, 30.0, 60.0)
QUANTILES = (0.5, 0.9, 0.99)


def quantile(ordered: Sequence[float], q: float) -> float:
    """The nearest-rank q-quantile (0..1) of sorted ``ordered``; NaN when there are none."""
    if not ordered:
        return float("nan")
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])


class DiagMetrics:
    """The series of one agent, in their own registry; feed them, then :meth:`serve`."""

    def __init__(self, node_id: str = "", recent_collectives: Callable[[], Iterable[float]]
                 = tuple) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.node_id = node_id
        self.step_seconds = Histogram(
            "elasticft_step_seconds", "Time between two optimizer steps of a rank.", ["rank"],
            buckets=STEP_BUCKETS, registry=self.registry)
        self.collective_seconds = Histogram(
            "elasticft_collective_seconds",
            "Duration of timed collectives and DDP buckets (enqueue to completion).",
            buckets=COLLECTIVE_BUCKETS, registry=self.registry)
        self.collective_latency = Gauge(
            "elasticft_collective_latency_seconds",
            "Quantiles of the recent collective durations the hang detector learns from.",
            ["quantile"], registry=self.registry)
        self.detections = Counter(
            "elasticft_detections", "Detections raised by this node's diagnostics.",
            ["detector"], registry=self.registry)
        self.restarts = Gauge("elasticft_worker_restarts",
                              "Worker group restarts of this agent so far.",
                              registry=self.registry)
        self.round = Gauge("elasticft_rendezvous_round", "Rendezvous round of the running group.",
                           registry=self.registry)
        self.workers = Gauge("elasticft_workers", "Workers this agent runs.",
                             registry=self.registry)
        self.last_step = Gauge("elasticft_last_step", "Latest optimizer step number of a rank.",
                               ["rank"], registry=self.registry)
        self.recent_collectives = recent_collectives
        """Returns the recent collective durations (set by the monitor that feeds this)."""
        for q in QUANTILES:
            self.collective_latency.labels(quantile=f"{q:g}").set_function(
                lambda q=q: quantile(self._recent_sorted(), q))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def _recent_sorted(self) -> list[float]:
        # Scrapes run on the server's thread while the monitor appends to the deque it reads;
        # copying a deque that changes meanwhile raises RuntimeError: copy again.
        for _ in range(10):
            try:
                return sorted(self.recent_collectives())
            except RuntimeError:
                continue
        return []

    # -- feeding --------------------------------------------------------------------------------

    def step(self, rank: int, number: int, seconds: float | None) -> None:
        self.last_step.labels(rank=str(rank)).set(number)
        if seconds is not None:
            self.step_seconds.labels(rank=str(rank)).observe(seconds)

    def collective(self, seconds: float) -> None:
        self.collective_seconds.observe(seconds)

    def detection(self, detector: str) -> None:
        self.detections.labels(detector=detector).inc()

    def group(self, restarts: int, round_: int, workers: int) -> None:
        self.restarts.set(restarts)
        self.round.set(round_)
        self.workers.set(workers)

    # -- serving --------------------------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def serve(self, host: str, port: int, token: str | None = None) -> tuple[str, int]:
        """Starts the HTTP endpoint (``/metrics``, any path) on a daemon thread."""
        if self._server is not None:
            address = self.address
            assert address is not None
            return address
        app = _require_token(make_wsgi_app(self.registry), token)
        try:
            server = make_server(host, port, app, server_class=_ThreadingWSGIServer,
                                 handler_class=_QuietHandler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on {host}:{port} ({e.strerror}); "
                          "choose another port for --diag-metrics") from e
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True,
                                        name="elasticft-diag-metrics")
        self._thread.start()
        address = self.address
        assert address is not None
        logger.info("diagnostics metrics on http://%s:%d/metrics", *address)
        return address

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _require_token(app: Callable[..., Any], token: str | None) -> Callable[..., Any]:
    if not token:
        return app
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                 ("WWW-Authenticate", "Bearer")])
            return [b"missing or wrong bearer token\n"]
        return app(environ, start_response)

    return guarded


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics: " + format, *args)
