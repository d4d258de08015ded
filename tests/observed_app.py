"""The test application with tracing on, as a worker process imports it: ``tests.observed_app:queue``.

Configured from the environment the test sets for the subprocess: each span
the process ends is appended, one JSON object a line, to the file named by
``SA_TASKQUEUE_TEST_TRACE_FILE`` as it ends (a worker stopped by a signal
may leave without running exit handlers).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from datetime import timedelta

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from sa_taskqueue.integrations.otel import OpenTelemetryTracing
from tests.app import make_engine, make_queue


class JsonLinesExporter(SpanExporter):
    """Appends each finished span to a file: its ids, parent, kind, name, status and attributes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_record(span)) + "\n" for span in spans]
        with self._lock, open(self.path, "a", encoding="utf-8") as file:
            file.writelines(lines)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict[str, object]:
    context = span.get_span_context()
    assert context is not None
    return {
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
        "parent_id": None if span.parent is None else format(span.parent.span_id, "016x"),
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "pid": os.getpid(),
    }


queue = make_queue(
    make_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"]),
    os.environ.get("SA_TASKQUEUE_TEST_STRATEGY") or None,
    timedelta(seconds=float(os.environ.get("SA_TASKQUEUE_TEST_LEASE", "300"))),
)
provider = TracerProvider()
provider.add_span_processor(
    SimpleSpanProcessor(JsonLinesExporter(os.environ["SA_TASKQUEUE_TEST_TRACE_FILE"]))
)
tracing = OpenTelemetryTracing(queue, tracer_provider=provider).attach()
