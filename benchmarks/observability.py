"""The worker's drain with metrics and tracing off, and on, taking turns in one run.

Each drain is W processes of ``run_worker(concurrency=B, burst=True)`` over
N no-op tasks, as the peers section's ``sa_taskqueue`` worker.  ``off`` is a
worker nobody observes: no subscriber, so the worker builds none of the
events metrics and traces hear, and tasks enqueued without tracing carry no
headers.  ``metrics`` is a worker with `PrometheusMetrics` alone; ``on`` is
a worker with both on, as an application would run it:

- `PrometheusMetrics` attached (counters and histograms recorded for every
  claim, run, outcome and statement; the table gauges are read only when
  scraped, and no drain is scraped);
- `OpenTelemetryTracing` attached to the SDK's tracer provider, every span
  sampled and handed to a batch span processor whose exporter drops them
  (what it costs to send them is the exporter's, not the library's);
- every task enqueued under a trace: its ``headers`` hold a ``traceparent``,
  which each run's span continues.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.drain import DrainResult, seed, start_together

#: The drains of the section, in the order they take turns: nothing observed, metrics alone, both.
MODES = ("off", "metrics", "on")
#: The trace context every task of the ``on`` drain carries, as an enqueue under a trace stores it.
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def observe(queue: Any, mode: str) -> Any:
    """Metrics, and tracing for ``on``, attached to ``queue``; the tracer provider, to flush at the end."""
    from prometheus_client import CollectorRegistry

    from sa_taskqueue.integrations.prometheus import PrometheusMetrics

    PrometheusMetrics(queue, registry=CollectorRegistry()).attach()
    if mode != "on":
        return None
    # (Imported only here: a worker with metrics alone loads nothing of OpenTelemetry.)
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from sa_taskqueue.integrations.otel import OpenTelemetryTracing

    class Dropped(SpanExporter):
        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    OpenTelemetryTracing(queue, tracer_provider=provider).attach()
    return provider


def _worker(mode: str, url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine, lease=timedelta(minutes=5))
    queue.task(name="noop")(lambda: None)
    provider = observe(queue, mode) if mode != "off" else None
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05)
    last = time.perf_counter()
    if provider is not None:
        provider.shutdown()  # (the spans still batched are handed over: their cost is counted too)
    results.put(last)
    queue.close()
    engine.dispose()


def observed_drain(url: str, tasks: int, workers: int, batch: int, mode: str) -> DrainResult:
    """One run of ``mode`` (of `MODES`): a fresh table, ``tasks`` tasks, ``workers`` worker processes."""
    fresh_table(url)
    if mode == "on":
        seed(url, tasks, headers={"traceparent": TRACEPARENT})
    else:
        seed(url, tasks)
    together = start_together(_worker, (mode, url, batch), workers, meter=url)
    ran_once = _ran_once(url)
    return DrainResult(
        seconds=max(max(together.outcomes) - together.started, 1e-9),
        tasks=ran_once,
        exactly_once=ran_once == tasks,
    ).with_costs(together.client_cpu, together.usage)


def _ran_once(url: str) -> int:
    """Tasks completed on their first attempt: every task, in a drain where each ran exactly once."""
    import sa_taskqueue as tq

    table = tq.Task.__table__
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            count = conn.scalar(
                sa.select(sa.func.count())
                .select_from(table)
                .where(table.c.status == tq.TaskStatus.COMPLETED, table.c.attempts == 1)
            )
    finally:
        engine.dispose()
    return int(count or 0)
