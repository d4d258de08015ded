"""OpenTelemetry metrics and tracing of a queue, through the OpenTelemetry API alone.

Needs the ``otel`` extra (``pip install 'sa_taskqueue[otel]'``: the
``opentelemetry-api`` package).  The application owns the SDK: its meter and
tracer providers, sampling and exporters; without an SDK configured the API
records nothing, at next to no cost.

- `OpenTelemetryMetrics` reports the metrics `PrometheusMetrics` reports,
  with the same names (dots for underscores, units as units) and attributes.
- `OpenTelemetryTracing` makes a PRODUCER span ``send <queue>`` for each
  enqueue and a CONSUMER span ``process <queue>`` for each run, with the
  messaging semantic conventions' attributes.  The enqueue injects its
  trace context (W3C ``traceparent``, ``tracestate``) into the task's
  ``headers`` column, and the run continues it: one trace shows the request
  that enqueued a task, the enqueue, and the run on another machine.

Both are subscribers of the queue's event stream; ``attach()`` starts them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Meter, MeterProvider, Observation
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider

from sa_taskqueue.core import session_events
from sa_taskqueue.core.error_text import error_message
from sa_taskqueue.core.events import EnqueueEvent, EventKind, EventStream, TaskEvent
from sa_taskqueue.core.model import TaskMixin
from sa_taskqueue.features.queue_gauges import DEFAULT_INTERVAL, GaugeMode, GaugeReader, QueueGauges
from sa_taskqueue.integrations.task_metrics import (
    DURATION_BUCKETS,
    STATEMENT_BUCKETS,
    WAIT_BUCKETS,
    EventMetrics,
    ObservedQueue,
)

#: The instrumentation scope's name: what the meter and the tracer are named.
SCOPE = "sa_taskqueue"
#: ``messaging.system``: the semantic conventions' name for the messaging system, ours.
MESSAGING_SYSTEM = "sa_taskqueue"


def _version() -> str | None:
    try:
        return version("sa_taskqueue")
    except PackageNotFoundError:  # (run from a checkout that is not installed)
        return None


class OpenTelemetryMetrics(EventMetrics):
    """One queue's metrics as OpenTelemetry instruments of the meter ``sa_taskqueue``.

    The global meter provider's unless ``meter_provider`` is given.  The
    instruments, their units and attributes are `PrometheusMetrics`' (an
    OpenTelemetry Prometheus exporter shows the same names): counters
    ``sa_taskqueue.tasks.enqueued``, ``.tasks.finished``
    and ``.statements``; histograms in seconds ``sa_taskqueue.task.duration``,
    ``.task.queue_wait`` and ``.statement.duration``; and observable gauges
    read from the tables at collection (``sa_taskqueue.queue.depth``,
    ``.queue.oldest_due_age``, ``.live_workers``), by one process at a time as
    ``gauges`` says (see `PrometheusMetrics`).
    """

    def __init__(
        self,
        queue: ObservedQueue,
        *,
        meter_provider: MeterProvider | None = None,
        gauges: GaugeMode = "lease",
        gauge_interval: timedelta = DEFAULT_INTERVAL,
    ) -> None:
        super().__init__(queue)
        self.reader = GaugeReader(
            queue.engine,
            queue.table,
            queue.clock,
            call=queue.run_sync,
            mode=gauges,
            interval=gauge_interval,
        )
        meter: Meter = metrics.get_meter(SCOPE, _version() or "", meter_provider)
        self._attributes: dict[tuple[str, ...], dict[str, str]] = {}
        self.tasks_enqueued = meter.create_counter(
            "sa_taskqueue.tasks.enqueued", "{task}", "Tasks enqueued by this process, once committed."
        )
        self.tasks_finished = meter.create_counter(
            "sa_taskqueue.tasks.finished",
            "{task}",
            "Task outcomes written: succeeded, failed (for good), retried, cancelled.",
        )
        self.task_duration = meter.create_histogram(
            "sa_taskqueue.task.duration",
            "s",
            "A task's run, from its start to its outcome.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.task_queue_wait = meter.create_histogram(
            "sa_taskqueue.task.queue_wait",
            "s",
            "How long a run waited to be claimed once its task was due (claim time minus run_at), "
            "recorded with the run's outcome.",
            explicit_bucket_boundaries_advisory=WAIT_BUCKETS,
        )
        self.statements = meter.create_counter(
            "sa_taskqueue.statements",
            "{statement}",
            "Claim and outcome statements sent by this process's workers, by operation and outcome.",
        )
        self.statement_duration = meter.create_histogram(
            "sa_taskqueue.statement.duration",
            "s",
            "A claim or outcome statement's latency, from sending it to its rows back.",
            explicit_bucket_boundaries_advisory=STATEMENT_BUCKETS,
        )
        meter.create_observable_gauge(
            "sa_taskqueue.queue.depth",
            [self._observe_depth],
            "{task}",
            "Tasks queued and running, by queue and status (read from the table).",
        )
        meter.create_observable_gauge(
            "sa_taskqueue.queue.oldest_due_age",
            [self._observe_oldest],
            "s",
            "Time since the oldest due queued task of each queue became due (read from the table).",
        )
        meter.create_observable_gauge(
            "sa_taskqueue.live_workers",
            [self._observe_live],
            "{worker}",
            "Workers whose registry row has not expired (read from the table).",
        )
        self._observing = False

    def attach(self) -> OpenTelemetryMetrics:  # type: ignore[override]
        """Start hearing the queue's events, and let the gauges read the tables; returns self."""
        super().attach()
        self._observing = True
        return self

    def detach(self) -> None:
        """Stop hearing the events; the gauges observe nothing more, and the lease is let go."""
        super().detach()
        self._observing = False
        self.reader.close()

    def _attrs(self, *pairs: str) -> dict[str, str]:
        # (names and values alternate; one dict kept per combination, as the SDK keeps them anyway)
        attributes = self._attributes.get(pairs)
        if attributes is None:
            attributes = self._attributes[pairs] = dict(zip(pairs[::2], pairs[1::2], strict=True))
        return attributes

    def enqueued(self, queue: str, task: str) -> None:
        self.tasks_enqueued.add(1, self._attrs("queue", queue, "task", task))

    def claimed(self, queue: str, task: str, wait: float) -> None:
        self.task_queue_wait.record(wait, self._attrs("queue", queue, "task", task))

    def finished(self, queue: str, task: str, outcome: str, duration: float | None) -> None:
        self.tasks_finished.add(1, self._attrs("queue", queue, "task", task, "outcome", outcome))
        if duration is not None:
            self.task_duration.record(duration, self._attrs("queue", queue, "task", task))

    def statement(self, operation: str, seconds: float, ok: bool) -> None:
        self.statements.add(1, self._attrs("operation", operation, "outcome", "ok" if ok else "error"))
        self.statement_duration.record(seconds, self._attrs("operation", operation))

    # The gauges: each callback asks the reader, which reads at most once per interval.

    def _reading(self) -> QueueGauges | None:
        return self.reader.read() if self._observing else None

    def _observe_depth(self, options: CallbackOptions) -> Iterable[Observation]:
        reading = self._reading()
        if reading is None:
            return []
        return [
            Observation(count, {"queue": queue, "status": str(status)})
            for (queue, status), count in sorted(reading.depth.items())
        ]

    def _observe_oldest(self, options: CallbackOptions) -> Iterable[Observation]:
        reading = self._reading()
        if reading is None:
            return []
        return [Observation(age, {"queue": queue}) for queue, age in sorted(reading.oldest_due_age.items())]

    def _observe_live(self, options: CallbackOptions) -> Iterable[Observation]:
        reading = self._reading()
        if reading is None or reading.live_workers is None:
            return []
        return [Observation(reading.live_workers)]


#: The kinds that end a run's span, and whether the run failed.
_RUN_ENDS = {
    EventKind.SUCCEEDED: False,
    EventKind.FAILED: True,
    EventKind.RETRIED: True,
    EventKind.LEASE_LOST: False,
    EventKind.GIVEN_BACK: False,
}


class OpenTelemetryTracing:
    """Spans for a queue's enqueues and runs, the enqueue's trace context carried in the task's headers.

    The tracer is ``sa_taskqueue``'s of the global tracer provider unless
    ``tracer_provider`` is given; the trace context goes through the global
    propagator (W3C trace context unless the application set another) unless
    ``propagator`` is given.

    - Each ``queue.enqueue``, ``task.enqueue`` and ``queue.enqueue_many`` is a
      PRODUCER span named ``send <queue>``, a child of the span current where
      it is called, ended once the rows are in the session.  Its context is
      stored with the tasks, in ``headers``.
    - Each run is a CONSUMER span named ``process <queue>``, from the task's
      claim to its written outcome, whose parent is the context its headers
      carry (a task enqueued with no trace context starts a trace of its own).
      A failure sets the span's status to ERROR and records the exception; a
      success leaves it unset.

    Spans carry the messaging conventions' attributes: ``messaging.system``
    (``sa_taskqueue``), ``messaging.destination.name`` (the queue),
    ``messaging.operation.type`` and ``.name`` (``send``, ``process``),
    ``messaging.message.id`` (the task's id; for ``enqueue_many``, the batch's
    ``messaging.batch.message_count`` instead), and ``sa_taskqueue.task.name``
    and, for a run, ``sa_taskqueue.task.attempt``.
    """

    def __init__(
        self,
        queue: ObservedQueue,
        *,
        tracer_provider: TracerProvider | None = None,
        propagator: TextMapPropagator | None = None,
    ) -> None:
        self.events: EventStream = queue.events
        self.table = queue.table
        self.tracer: Tracer = trace.get_tracer(SCOPE, _version(), tracer_provider)
        self._propagator = propagator
        self._process_attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
        }
        self._lock = threading.Lock()
        self._unsubscribe: list[Callable[[], None]] = []

    def attach(self) -> OpenTelemetryTracing:
        """Start making spans; returns self."""
        with self._lock:
            if not self._unsubscribe:
                self._unsubscribe = [
                    self.events.subscribe(self._enqueuing, [EventKind.ENQUEUING]),
                    self.events.subscribe(self._ended, list(_RUN_ENDS)),
                    session_events.add_row_headers(self._added_row),
                ]
        return self

    def detach(self) -> None:
        """Stop making spans (a run whose outcome comes later gets none)."""
        with self._lock:
            for unsubscribe in self._unsubscribe:
                unsubscribe()
            self._unsubscribe = []

    def __enter__(self) -> OpenTelemetryTracing:
        return self.attach()

    def __exit__(self, *exc_info: object) -> None:
        self.detach()

    @property
    def propagator(self) -> TextMapPropagator:
        return self._propagator if self._propagator is not None else get_global_textmap()

    def _enqueuing(self, event: EnqueueEvent) -> None:
        attributes: dict[str, Any] = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.destination.name": event.queue,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "sa_taskqueue.task.name": event.task_name,
        }
        if event.count != 1:
            attributes["messaging.batch.message_count"] = event.count
        span = self.tracer.start_span(f"send {event.queue}", kind=SpanKind.PRODUCER, attributes=attributes)
        if not span.get_span_context().is_valid:
            return  # no tracer provider configured: no trace to carry
        self.propagator.inject(event.headers, context=trace.set_span_in_context(span))

        def written(ids: Sequence[int | None] | None, error: BaseException | None) -> None:
            if error is not None:
                span.record_exception(error)
                span.set_status(Status(StatusCode.ERROR, error_message(error)))
            elif ids is not None and len(ids) == 1 and ids[0] is not None:
                span.set_attribute("messaging.message.id", str(ids[0]))
            span.end()

        event.written.append(written)

    def _added_row(self, row: TaskMixin) -> dict[str, str] | None:
        """A row of this queue's table from ``session.add``: a ``send`` span, its context in the headers."""
        if getattr(type(row), "__table__", None) is not self.table:
            return None
        queue = row.queue if isinstance(row.queue, str) else "default"  # (the column's default, at INSERT)
        attributes = {
            "messaging.system": MESSAGING_SYSTEM,
            "messaging.destination.name": queue,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "sa_taskqueue.task.name": str(row.name),
        }
        span = self.tracer.start_span(f"send {queue}", kind=SpanKind.PRODUCER, attributes=attributes)
        try:
            if not span.get_span_context().is_valid:
                return None
            headers: dict[str, str] = {}
            self.propagator.inject(headers, context=trace.set_span_in_context(span))
            return headers
        finally:
            span.end()  # (the row's id comes with the flush: the span says which task by its name only)

    def _ended(self, event: TaskEvent) -> None:
        """A run's span, made whole once its outcome is written: from its claim to that outcome.

        Made at the end rather than at the start, the span costs the worker
        no event at the start and no table of the spans open: its start time
        is the claim's (``started_at``), its end now.
        """
        task = event.task
        if task is None or (event.kind is EventKind.GIVEN_BACK and event.duration is None):
            return  # (a task given back before it started had no run)
        raw = task.raw_headers
        parent = self.propagator.extract(task.headers, context=_EMPTY) if raw is not None else _EMPTY
        attributes = dict(self._process_attributes)
        attributes["messaging.destination.name"] = task.queue
        attributes["messaging.message.id"] = str(task.id)
        attributes["sa_taskqueue.task.name"] = task.name
        attributes["sa_taskqueue.task.attempt"] = task.attempts
        kind = event.kind
        if kind is EventKind.LEASE_LOST or kind is EventKind.GIVEN_BACK:
            attributes["sa_taskqueue.task.outcome"] = str(kind)
        elif kind is not EventKind.SUCCEEDED:
            attributes["sa_taskqueue.task.retried"] = kind is EventKind.RETRIED
        span = self.tracer.start_span(
            f"process {task.queue}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attributes,
            start_time=int(task.started_at.timestamp() * 1e9),
        )
        if _RUN_ENDS[kind]:
            # A success leaves the status unset, as instrumentation does; a failure is an error.
            error = event.error
            if isinstance(error, BaseException):
                span.record_exception(error)
                description = error_message(error)
            else:
                description = "" if error is None else str(error)
            span.set_status(Status(StatusCode.ERROR, description))
        span.end()


#: The context a run's span starts from when its task carries none: a trace of its own.
_EMPTY = otel_context.Context()


__all__ = ["MESSAGING_SYSTEM", "SCOPE", "OpenTelemetryMetrics", "OpenTelemetryTracing"]
