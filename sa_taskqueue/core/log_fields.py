"""The structured fields the worker attaches to its log lines about one task.

A log shipper filters and aggregates on fields (every failure of one task
name, the slowest attempts) rather than on parsed messages; the JSON log
format writes these beside the message.  They travel as a log record's
``extra``, so any handler an application installs can read them too.
"""

from __future__ import annotations

from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask

#: Every field a worker's log line may carry, in the order the JSON format writes them.
#: ``task_name``, not ``name``: a log record already has a ``name`` (the logger's).
TASK_LOG_FIELDS = ("task_id", "task_name", "queue", "attempt", "duration_ms", "worker_id", "error")


def task_fields(
    task: ClaimedTask,
    worker_id: str,
    *,
    duration: float | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """The fields of a log line about one attempt of ``task``; ``duration`` in seconds."""
    fields: dict[str, Any] = {
        "task_id": task.id,
        "task_name": task.name,
        "queue": task.queue,
        "attempt": task.attempts,
        "worker_id": worker_id,
    }
    if duration is not None:
        fields["duration_ms"] = round(duration * 1000, 3)
    if error is not None:
        fields["error"] = error
    return fields


__all__ = ["TASK_LOG_FIELDS", "task_fields"]
