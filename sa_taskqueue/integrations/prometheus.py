"""Prometheus metrics of a queue: `PrometheusMetrics`, and the ways to serve them.

Needs the ``metrics`` extra (``pip install 'sa_taskqueue[metrics]'``: the
``prometheus_client`` library).  ``PrometheusMetrics(queue).attach()`` makes
the queue's events in this process counters and histograms, and reads the
queue-depth gauges from its tables when scraped::

    from sa_taskqueue.integrations.prometheus import PrometheusMetrics, serve_metrics

    PrometheusMetrics(queue).attach()
    serve_metrics(9100)  # or: sa-taskqueue worker app:queue --metrics-port 9100

A web application mounts `metrics_app` (ASGI) or answers with
`metrics_exposition` instead.  The metrics, their labels and units are
listed in the how-to "Metrics and tracing".

With no `PrometheusMetrics` attached nothing is recorded and the worker
builds none of the events these metrics hear.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from datetime import timedelta
from itertools import accumulate
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, make_asgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder, start_http_server
from prometheus_client.registry import Collector

from sa_taskqueue.features.queue_gauges import DEFAULT_INTERVAL, GaugeMode, GaugeReader, QueueGauges
from sa_taskqueue.integrations.task_metrics import (
    DURATION_BUCKETS,
    STATEMENT_BUCKETS,
    WAIT_BUCKETS,
    EventMetrics,
    ObservedQueue,
)

#: The first part of every metric's name.
PREFIX = "sa_taskqueue"

ASGIApp = Callable[
    [MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
    Awaitable[None],
]


class PrometheusMetrics(EventMetrics):
    """One queue's metrics in a Prometheus registry (the default registry unless ``registry`` is given).

    Counters and histograms (``_total``, ``_seconds``) are recorded from the
    queue's events as they happen in this process: its enqueues, and the
    claims, runs and outcomes of its workers.  The gauges (queue depth by
    queue and status, the oldest due task's age, the live workers) are read
    from the tables when the registry is collected, at most once per
    ``gauge_interval``, and by one process at a time: ``gauges="lease"``
    (the default) reads them only while this process holds the metrics lease
    of the control table, so N workers scraped every 15 seconds make one
    reading, not N; ``"always"`` reads them whenever asked (a dashboard, the
    one process that serves them); ``"never"`` leaves them out.

    ``attach()`` starts hearing the events and returns self; ``detach()``
    stops, takes the metrics out of the registry and lets the lease go.
    One `PrometheusMetrics` per registry: their names would clash.
    """

    def __init__(
        self,
        queue: ObservedQueue,
        *,
        registry: CollectorRegistry | None = None,
        gauges: GaugeMode = "lease",
        gauge_interval: timedelta = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__(queue)
        self.registry = REGISTRY if registry is None else registry
        self.reader = GaugeReader(
            queue.engine,
            queue.table,
            queue.clock,
            call=queue.run_sync,
            mode=gauges,
            interval=gauge_interval,
        )
        self._collectors: list[Collector] = []
        self.tasks_enqueued = self._add(
            _Counter(
                f"{PREFIX}_tasks_enqueued",
                "Tasks enqueued by this process, counted once their transaction commits.",
                ("queue", "task"),
            )
        )
        self.tasks_finished = self._add(
            _Counter(
                f"{PREFIX}_tasks_finished",
                "Task outcomes written: succeeded, failed (for good), retried (failed, to run again), "
                "cancelled.",
                ("queue", "task", "outcome"),
            )
        )
        self.task_duration = self._add(
            _Histogram(
                f"{PREFIX}_task_duration_seconds",
                "A task's run, from its start to its outcome, in seconds.",
                ("queue", "task"),
                DURATION_BUCKETS,
            )
        )
        self.task_queue_wait = self._add(
            _Histogram(
                f"{PREFIX}_task_queue_wait_seconds",
                "How long a run waited to be claimed once its task was due (claim time minus run_at), "
                "in seconds, recorded with the run's outcome.",
                ("queue", "task"),
                WAIT_BUCKETS,
            )
        )
        self.statements = self._add(
            _Counter(
                f"{PREFIX}_statements",
                "Claim and outcome statements sent by this process's workers, by operation and outcome.",
                ("operation", "outcome"),
            )
        )
        self.statement_duration = self._add(
            _Histogram(
                f"{PREFIX}_statement_duration_seconds",
                "A claim or outcome statement's latency, from sending it to its rows back, in seconds.",
                ("operation",),
                STATEMENT_BUCKETS,
            )
        )
        self._add(_TableGauges(self.reader))

    def _add(self, collector: Any) -> Any:
        self._collectors.append(collector)
        return collector

    def attach(self) -> PrometheusMetrics:  # type: ignore[override]
        """Register the metrics and start hearing the queue's events; returns self."""
        with self._lock:
            registered = self._unsubscribe is not None
        if not registered:
            for collector in self._collectors:
                self.registry.register(collector)
        super().attach()
        return self

    def detach(self) -> None:
        """Stop hearing the events, take the metrics out of the registry, and let the gauge lease go."""
        with self._lock:
            attached = self._unsubscribe is not None
        super().detach()
        if attached:
            for collector in self._collectors:
                self.registry.unregister(collector)
            self.reader.close()

    def __enter__(self) -> PrometheusMetrics:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    def enqueued(self, queue: str, task: str) -> None:
        self.tasks_enqueued.inc((queue, task))

    def claimed(self, queue: str, task: str, wait: float) -> None:
        self.task_queue_wait.observe((queue, task), wait)

    def finished(self, queue: str, task: str, outcome: str, duration: float | None) -> None:
        self.tasks_finished.inc((queue, task, outcome))
        if duration is not None:
            self.task_duration.observe((queue, task), duration)

    def statement(self, operation: str, seconds: float, ok: bool) -> None:
        self.statements.inc((operation, "ok" if ok else "error"))
        self.statement_duration.observe((operation,), seconds)


# prometheus_client's Counter and Histogram take a lock for each value they change (a histogram's
# sum and its bucket: two), check that the metric is observable, and walk the buckets one by one:
# about 2 µs an observation, paid by the worker for every task.  These keep the same figures in a
# dict under one lock, the bucket found by bisection, and build the families only when scraped.


def _go_float(bound: float) -> str:
    """A bucket's bound as Prometheus writes it in ``le`` (``1.0``, ``0.005``)."""
    return repr(float(bound))


class _Counter(Collector):
    """A counter by label values: ``<name>_total``."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self._values: dict[tuple[str, ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, labels: tuple[str, ...], amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: tuple[str, ...]) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(self.name, self.documentation, labels=self.labels)]

    def collect(self) -> Iterable[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labels)
        with self._lock:
            values = sorted(self._values.items())
        for labels, value in values:
            family.add_metric(list(labels), value)
        return [family]


class _Histogram(Collector):
    """A histogram by label values: ``<name>_bucket``, ``_sum`` and ``_count``."""

    def __init__(
        self, name: str, documentation: str, labels: tuple[str, ...], buckets: tuple[float, ...]
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labels = labels
        self.bounds = tuple(sorted(buckets))
        # Per label values: a count per bucket (the last for +Inf), then the sum.
        self._values: dict[tuple[str, ...], list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, labels: tuple[str, ...], amount: float) -> None:
        index = bisect_left(self.bounds, amount)  # (a bucket's bound is its values' upper bound, inclusive)
        with self._lock:
            row = self._values.get(labels)
            if row is None:
                row = self._values[labels] = [0.0] * (len(self.bounds) + 2)
            row[index] += 1
            row[-1] += amount

    def count(self, labels: tuple[str, ...]) -> float:
        with self._lock:
            row = self._values.get(labels)
            return 0.0 if row is None else sum(row[:-1])

    def describe(self) -> Iterable[Metric]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=self.labels)]

    def collect(self) -> Iterable[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labels)
        with self._lock:
            rows = sorted((labels, list(row)) for labels, row in self._values.items())
        for labels, row in rows:
            cumulative = list(accumulate(row[:-1]))
            buckets = [(_go_float(bound), cumulative[i]) for i, bound in enumerate(self.bounds)]
            buckets.append(("+Inf", cumulative[-1]))
            family.add_metric(list(labels), buckets, row[-1])
        return [family]


class _TableGauges(Collector):
    """The gauges read from the tables at collection time (`GaugeReader`)."""

    def __init__(self, reader: GaugeReader) -> None:
        self._reader = reader

    def describe(self) -> Iterable[Metric]:
        # Named without reading the tables: registering must not query the database.
        return _families(None)

    def collect(self) -> Iterable[Metric]:
        return _families(self._reader.read())


def _families(reading: QueueGauges | None) -> list[Metric]:
    depth = GaugeMetricFamily(
        f"{PREFIX}_queue_depth",
        "Tasks queued and running, by queue and status (read from the table).",
        labels=["queue", "status"],
    )
    oldest = GaugeMetricFamily(
        f"{PREFIX}_queue_oldest_due_age_seconds",
        "Seconds since the oldest due queued task of each queue became due (read from the table).",
        labels=["queue"],
    )
    live = GaugeMetricFamily(
        f"{PREFIX}_live_workers", "Workers whose registry row has not expired (read from the table)."
    )
    if reading is None:
        return [depth, oldest, live]
    for (queue, status), count in sorted(reading.depth.items()):
        depth.add_metric([queue, status], count)
    for queue, age in sorted(reading.oldest_due_age.items()):
        oldest.add_metric([queue], age)
    families: list[Metric] = [depth, oldest]
    if reading.live_workers is not None:
        live.add_metric([], reading.live_workers)
        families.append(live)
    return families


def metrics_exposition(
    registry: CollectorRegistry | None = None, accept: str | None = None
) -> tuple[bytes, str]:
    """The registry's metrics as a scrape answers them: the body, and its ``Content-Type``.

    ``accept`` is the request's ``Accept`` header, which picks the format
    (the Prometheus text format unless OpenMetrics is asked for).  For a web
    framework's own ``/metrics`` route.
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(REGISTRY if registry is None else registry), content_type


def metrics_app(registry: CollectorRegistry | None = None) -> ASGIApp:
    """A tiny ASGI application answering every GET with the registry's metrics: mount it at ``/metrics``."""
    app: ASGIApp = make_asgi_app(REGISTRY if registry is None else registry)
    return app


def serve_metrics(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> Any:
    """Serve the registry's metrics over HTTP on ``addr:port`` from a daemon thread; returns the server.

    The server's ``shutdown()`` stops it.  Port 0 picks a free port:
    ``server.server_port`` says which.
    """
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer from 0 to 65535, got {port!r}")
    server, _thread = start_http_server(port, addr, REGISTRY if registry is None else registry)
    return server


__all__ = ["PREFIX", "PrometheusMetrics", "metrics_app", "metrics_exposition", "serve_metrics"]
