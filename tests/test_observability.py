"""Metrics and tracing: a worker's Prometheus scrape, OpenTelemetry metrics, and one trace across processes.

The scrape is of a real worker process started with ``--metrics-port``,
parsed with prometheus_client's own parser; the trace is made by this
process (the enqueue) and by a worker process (the run), whose spans it
writes to a file as they end (`tests.observed_app`).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from opentelemetry import trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.core.worker_table import worker_table_of
from sa_taskqueue.integrations.otel import OpenTelemetryMetrics, OpenTelemetryTracing
from sa_taskqueue.integrations.prometheus import PrometheusMetrics, metrics_app, metrics_exposition
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import run_cli, start_cli, wait_until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
        return parse(answer.read().decode())


def add_live_worker(engine: sa.Engine, worker_id: str, expires_in: timedelta) -> None:
    """A row of the live-worker registry, as a worker writes it, expiring ``expires_in`` from now."""
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            sa.insert(worker_table_of(tq.Task.__table__)).values(
                id=worker_id,
                host="elsewhere",
                pid=1,
                queues=["default"],
                task_names=["record"],
                concurrency=1,
                version="0",
                started_at=now,
                heartbeat_at=now,
                expires_at=now + expires_in,
            )
        )


@pytest.fixture
def app_queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = make_queue(engine, None, timedelta(minutes=5))
    yield queue
    queue.close()


def test_a_worker_serves_its_metrics_on_the_metrics_port(
    backend: Backend, engine: sa.Engine, app_queue: tq.TaskQueue
) -> None:
    with Session(engine) as session:
        app_queue.enqueue_many(session, "record", [{"key": key} for key in range(4)])
        app_queue.enqueue(session, "boom", {"message": "no"}, max_attempts=2)
        # Two tasks of a queue the worker does not serve: what the depth gauges see waiting.
        app_queue.enqueue_many(session, "record", [{"key": 10}, {"key": 11}], queue="idle")
        session.commit()
    add_live_worker(engine, "live", timedelta(minutes=1))
    add_live_worker(engine, "gone", -timedelta(seconds=1))
    port = free_port()
    worker = start_cli(
        "worker",
        "tests.cli_app:queue",
        "--queues",
        "default",
        "--poll-interval",
        "0.05",
        "--metrics-port",
        str(port),
        url=backend.url,
    )
    try:
        finished: dict[str, Samples] = {}

        def all_finished() -> bool:
            try:
                samples = scrape(port)
            except OSError:
                return False  # not serving yet
            finished["samples"] = samples
            labels = {"queue": "default", "task": "record", "outcome": "succeeded"}
            failed = {"queue": "default", "task": "boom", "outcome": "failed"}
            # The table's gauges are read at most every few seconds: the
            # worker registers itself before its first claim, which a reading
            # taken at the first scrape may not have seen yet.
            return (
                value(samples, "sa_taskqueue_tasks_finished_total", **labels) == 4
                and value(samples, "sa_taskqueue_tasks_finished_total", **failed) == 1
                and value(samples, "sa_taskqueue_live_workers") == 2
            )

        wait_until(all_finished, 60, "the metrics to count every outcome and both workers", every=0.2)
        samples = finished["samples"]
    finally:
        worker.send_signal(signal.SIGTERM)
        _out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    record = {"queue": "default", "task": "record"}
    boom = {"queue": "default", "task": "boom"}
    # Counters: the retried attempt and the failure that ended the task, each once.
    assert value(samples, "sa_taskqueue_tasks_finished_total", **boom, outcome="retried") == 1
    # Histograms in seconds: one observation per run, its duration and its wait to be claimed.
    assert value(samples, "sa_taskqueue_task_duration_seconds_count", **record) == 4
    assert value(samples, "sa_taskqueue_task_duration_seconds_count", **boom) == 2
    assert value(samples, "sa_taskqueue_task_duration_seconds_bucket", **record, le="+Inf") == 4
    assert value(samples, "sa_taskqueue_task_queue_wait_seconds_count", **record) == 4
    assert value(samples, "sa_taskqueue_task_queue_wait_seconds_count", **boom) == 2
    assert (value(samples, "sa_taskqueue_task_queue_wait_seconds_sum", **record) or -1) >= 0
    # The worker's statements: at least one claim, and the outcomes' writes, each timed.
    claims = value(samples, "sa_taskqueue_statements_total", operation="claim", outcome="ok")
    assert claims is not None and claims >= 1
    assert value(samples, "sa_taskqueue_statement_duration_seconds_count", operation="claim") == claims
    written = sum(
        value(samples, "sa_taskqueue_statements_total", operation=operation, outcome="ok") or 0
        for operation in ("complete", "complete_and_claim", "fail")
    )
    assert written >= 2
    # Gauges read from the tables: the unserved queue's two tasks, its oldest due, and two live
    # workers: the row added as live and the worker itself (it registers before its first claim);
    # the expired row is not counted.
    assert value(samples, "sa_taskqueue_queue_depth", queue="idle", status="queued") == 2
    oldest = value(samples, "sa_taskqueue_queue_oldest_due_age_seconds", queue="idle")
    assert oldest is not None and oldest >= 0
    assert value(samples, "sa_taskqueue_live_workers") == 2


def test_a_worker_refuses_a_metrics_port_out_of_range(backend: Backend) -> None:
    result = run_cli("worker", "tests.cli_app:queue", "--metrics-port", "70000", url=backend.url)
    assert result.returncode == 2
    assert "--metrics-port" in result.stderr and "70000" in result.stderr


def test_only_the_lease_holder_reads_the_table_gauges(engine: sa.Engine, app_queue: tq.TaskQueue) -> None:
    with Session(engine) as session:
        app_queue.enqueue(session, "record", {"key": 1})
        session.commit()
    first = PrometheusMetrics(app_queue, registry=CollectorRegistry()).attach()
    second = PrometheusMetrics(app_queue, registry=CollectorRegistry()).attach()
    try:
        depth = ("sa_taskqueue_queue_depth", frozenset({("queue", "default"), ("status", "queued")}))
        assert parse(metrics_exposition(first.registry)[0].decode()).get(depth) == 1
        assert depth not in parse(metrics_exposition(second.registry)[0].decode()), "the lease is held"
        first.detach()  # lets the lease go
        second.reader._last = None  # (its interval has not passed: read again now)
        assert parse(metrics_exposition(second.registry)[0].decode()).get(depth) == 1
    finally:
        first.detach()
        second.detach()


def test_the_metrics_app_answers_a_scrape(engine: sa.Engine, app_queue: tq.TaskQueue) -> None:
    registry = CollectorRegistry()
    with PrometheusMetrics(app_queue, registry=registry, gauges="always"):
        with Session(engine) as session:
            app_queue.enqueue(session, "record", {"key": 1})
            session.commit()
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "headers": []}
        asyncio.run(metrics_app(registry)(scope, receive, send))
    assert sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"Content-Type"].startswith(b"text/plain")
    samples = parse(b"".join(message.get("body", b"") for message in sent[1:]).decode())
    assert value(samples, "sa_taskqueue_tasks_enqueued_total", queue="default", task="record") == 1
    assert value(samples, "sa_taskqueue_queue_depth", queue="default", status="queued") == 1


def otel_points(reader: InMemoryMetricReader) -> dict[str, dict[frozenset[tuple[str, Any]], Any]]:
    """Each metric's data points by attributes: a sum's value, a histogram's count, a gauge's value."""
    data = reader.get_metrics_data()
    assert data is not None
    found: dict[str, dict[frozenset[tuple[str, Any]], Any]] = {}
    units: dict[str, str] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                units[metric.name] = metric.unit or ""
                found[metric.name] = {
                    frozenset((point.attributes or {}).items()): getattr(point, "count", None)
                    if hasattr(point, "bucket_counts")
                    else point.value
                    for point in metric.data.data_points
                }
    found["units"] = {frozenset({("unit", name)}): unit for name, unit in units.items()}
    return found


def test_opentelemetry_metrics_report_the_same_figures(engine: sa.Engine, app_queue: tq.TaskQueue) -> None:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    observed = OpenTelemetryMetrics(app_queue, meter_provider=provider, gauges="always").attach()
    try:
        with Session(engine) as session:
            app_queue.enqueue_many(session, "record", [{"key": 1}, {"key": 2}])
            app_queue.enqueue(session, "boom", {"message": "no"}, max_attempts=1)
            app_queue.enqueue(session, "record", {"key": 3}, queue="idle")
            session.commit()
        tq.Worker(app_queue, queues=["default"], burst=True, watchdog=False, poll_interval=0.05).run()
        points = otel_points(reader)
    finally:
        observed.detach()
        provider.shutdown()
    record = frozenset({("queue", "default"), ("task", "record")})
    boom = frozenset({("queue", "default"), ("task", "boom")})
    assert points["sa_taskqueue.tasks.enqueued"][record] == 2
    assert points["sa_taskqueue.tasks.finished"][record | {("outcome", "succeeded")}] == 2
    assert points["sa_taskqueue.tasks.finished"][boom | {("outcome", "failed")}] == 1
    assert points["sa_taskqueue.task.duration"][record] == 2
    assert points["sa_taskqueue.task.queue_wait"][boom] == 1
    assert points["sa_taskqueue.statements"][frozenset({("operation", "claim"), ("outcome", "ok")})] >= 1
    assert points["sa_taskqueue.statement.duration"][frozenset({("operation", "claim")})] >= 1
    assert points["sa_taskqueue.queue.depth"][frozenset({("queue", "idle"), ("status", "queued")})] == 1
    assert points["sa_taskqueue.queue.oldest_due_age"][frozenset({("queue", "idle")})] >= 0
    assert points["sa_taskqueue.live_workers"][frozenset()] == 0
    units = points["units"]
    assert units[frozenset({("unit", "sa_taskqueue.task.duration")})] == "s"
    assert units[frozenset({("unit", "sa_taskqueue.statement.duration")})] == "s"


def read_spans(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def test_an_enqueue_and_its_run_in_a_worker_process_are_one_trace(
    backend: Backend, engine: sa.Engine, app_queue: tq.TaskQueue, tmp_path: Path
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = OpenTelemetryTracing(app_queue, tracer_provider=provider).attach()
    request = provider.get_tracer("the application")
    try:
        with request.start_as_current_span("POST /orders") as handling, Session(engine) as session:
            by_queue = app_queue.enqueue(session, "record", {"key": 1}).id
            by_task = app_queue.registered("record").enqueue(session, key=2).id  # type: ignore[union-attr]
            app_queue.enqueue_many(session, "record", [{"key": 3}, {"key": 4}])
            app_queue.enqueue(session, "boom", {"message": "no"}, max_attempts=1)
            session.add(tq.Task(name="record", params={"key": 5}))  # (added by hand: traced at the flush)
            session.commit()
    finally:
        tracing.detach()
    trace_id = format(handling.get_span_context().trace_id, "032x")
    sends = exporter.get_finished_spans()
    # One span for each enqueue (none twice for a row that both an enqueue and the flush see).
    assert [span.name for span in sends if span.name.startswith("send")] == ["send default"] * 5
    for span in sends:
        if span.name.startswith("send"):
            assert span.kind is trace.SpanKind.PRODUCER
            assert span.parent is not None and span.parent.span_id == handling.get_span_context().span_id
            assert span.attributes is not None
            assert span.attributes["messaging.system"] == "sa_taskqueue"
            assert span.attributes["messaging.destination.name"] == "default"
            assert span.attributes["messaging.operation.type"] == "send"
    ids = {span.attributes.get("messaging.message.id") for span in sends if span.attributes}
    assert {str(by_queue), str(by_task)} <= ids
    batch = [span for span in sends if span.attributes and "messaging.batch.message_count" in span.attributes]
    assert len(batch) == 1 and batch[0].attributes is not None
    assert batch[0].attributes["messaging.batch.message_count"] == 2
    send_of: dict[int, str] = {}
    with engine.connect() as conn:
        for task_id, headers in conn.execute(sa.select(tq.Task.id, tq.Task.headers)):
            send_of[task_id] = headers["traceparent"].split("-")[2]

    spans_file = tmp_path / "spans.jsonl"
    result = run_cli(
        "worker",
        "tests.observed_app:queue",
        "--burst",
        "--poll-interval",
        "0.05",
        url=backend.url,
        SA_TASKQUEUE_TEST_TRACE_FILE=str(spans_file),
    )
    assert result.returncode == 0, result.stderr
    runs = [span for span in read_spans(spans_file) if span["name"] == "process default"]
    assert len(runs) == 6
    for run in runs:
        task_id = int(run["attributes"]["messaging.message.id"])
        assert run["kind"] == "CONSUMER"
        assert run["trace_id"] == trace_id, "the run continues the request's trace"
        assert run["parent_id"] == send_of[task_id], "its parent is the enqueue's span"
        assert run["attributes"]["messaging.operation.type"] == "process"
        assert run["attributes"]["sa_taskqueue.task.attempt"] == 1
    statuses = {run["attributes"]["sa_taskqueue.task.name"]: run["status"] for run in runs}
    assert statuses == {"record": "UNSET", "boom": "ERROR"}


def test_without_tracing_a_task_carries_no_headers(engine: sa.Engine, app_queue: tq.TaskQueue) -> None:
    with Session(engine) as session:
        app_queue.enqueue(session, "record", {"key": 1})
        app_queue.enqueue_many(session, "record", [{"key": 2}])
        session.commit()
    with engine.connect() as conn:
        assert conn.scalars(sa.select(tq.Task.headers)).all() == [None, None]
    claimed = app_queue.claim(limit=2)
    assert [task.raw_headers for task in claimed] == [None, None]
    assert [task.headers for task in claimed] == [{}, {}]


def test_a_task_enqueued_with_a_trace_context_but_no_tracer_in_the_worker_still_runs(
    engine: sa.Engine, app_queue: tq.TaskQueue
) -> None:
    provider = TracerProvider()
    with (
        OpenTelemetryTracing(app_queue, tracer_provider=provider),
        provider.get_tracer("app").start_as_current_span("request"),
        Session(engine) as session,
    ):
        app_queue.enqueue(session, "record", {"key": 1})
        session.commit()
    (claimed,) = app_queue.claim(limit=1)
    assert set(claimed.headers) == {"traceparent"}
    assert app_queue.complete(claimed) is True


def test_a_scrape_without_the_tables_still_serves_the_counters(caplog: pytest.LogCaptureFixture) -> None:
    """An empty database (not migrated): the gauges are left out and logged, the rest is served."""
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))
    registry = CollectorRegistry()
    with PrometheusMetrics(queue, registry=registry, gauges="always") as metrics:
        metrics.finished("default", "record", "succeeded", 0.01)
        body, content_type = metrics_exposition(registry)
    samples = parse(body.decode())
    assert content_type.startswith("text/plain")
    labels = {"queue": "default", "task": "record", "outcome": "succeeded"}
    assert value(samples, "sa_taskqueue_tasks_finished_total", **labels) == 1
    assert not [key for key in samples if key[0] == "sa_taskqueue_queue_depth"]
    assert "queue gauges not read" in caplog.text
    queue.close()
