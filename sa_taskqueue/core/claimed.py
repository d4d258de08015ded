"""`ClaimedTask`: what a worker holds after a claim, detached from any session."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sa_taskqueue.core.claimed_params import Loads, decode_params

#: What tells one claim of a task from every other: id, worker, attempt and
#: start time.  Worker and attempt alone repeat when a task is given back
#: unrun and claimed again by the same worker; the start time does not.
ClaimKey = tuple[int, str, int, datetime]


@dataclass(frozen=True)
class ClaimedTask:
    """A plain snapshot of a task as it was claimed.

    It is not an ORM object: it stays valid after the claim's transaction has
    committed and its session is gone, and it can be passed between threads.
    ``locked_by``, ``attempts`` and ``started_at`` together identify this
    claim: ``complete`` and ``fail`` only act while the row still carries all
    three, so a worker whose lease has expired (and whose task someone else
    claimed) cannot overwrite the new holder's outcome.

    ``malformed`` says why a row cannot run as it stands (its params are not
    a JSON object, written around the queue); ``params`` is then empty, and
    the worker records the task as failed for good without running anything.
    """

    id: int
    name: str
    queue: str
    priority: int
    params: dict[str, Any]
    attempts: int
    max_attempts: int
    run_at: datetime
    created_at: datetime
    started_at: datetime
    locked_by: str
    locked_until: datetime
    malformed: str | None = None
    #: A limited task's key and the slot of it this run holds (``@queue.task(concurrency_limit=...)``);
    #: the slot is freed by the database as the row leaves RUNNING, so no write needs it.
    concurrency_key: str | None = None
    concurrency_slot: int | None = None
    #: What the enqueue carried beside the params (`Task.headers`: a trace context), as the claim
    #: read it: the column's JSON text, or None.  Decoded only by what reads it (`task_headers`), so
    #: a claim whose tasks nobody traces decodes nothing.
    raw_headers: Any = None
    #: The batch the task belongs to, and whether tasks depend on it, as the claim read them: such a
    #: task's final write goes through the workflow bookkeeping (`in_workflow`).
    batch_id: int | None = None
    has_dependents: bool | None = None

    @property
    def in_workflow(self) -> bool:
        """Whether the task belonged to a batch or had dependents when claimed."""
        return self.batch_id is not None or bool(self.has_dependents)

    @property
    def headers(self) -> dict[str, str]:
        """The task's headers as a dict (empty when it carries none, or what it carries is not an object)."""
        return task_headers(self.raw_headers)

    @classmethod
    def from_row(cls, row: Mapping[str, Any], loads: Loads = json.loads) -> ClaimedTask:
        """Build a snapshot from a claimed row (a mapping of column name to value).

        The row's params may be JSON text, decoded here with ``loads``; a row
        whose params are not a JSON object becomes a ``malformed`` snapshot
        rather than an error, so that the rest of its batch runs.
        """
        params, malformed = decode_params(row["params"], loads)
        fields = {
            "id": row["id"],
            "name": row["name"],
            "queue": row["queue"],
            "priority": row["priority"],
            "params": dict(params),
            "attempts": row["attempts"],
            "max_attempts": row["max_attempts"],
            "run_at": row["run_at"],
            "created_at": row["created_at"],
            "started_at": row["started_at"],
            "locked_by": row["locked_by"],
            "locked_until": row["locked_until"],
            "malformed": malformed,
            "concurrency_key": row.get("concurrency_key"),
            "concurrency_slot": row.get("concurrency_slot"),
            "raw_headers": row.get("headers"),
            "batch_id": row.get("batch_id"),
            "has_dependents": row.get("has_dependents"),
        }
        if cls is not ClaimedTask:
            return cls(**fields)  # (a subclass may check or add fields in its own __init__)
        # A frozen dataclass's __init__ sets each field through
        # object.__setattr__: about 5 µs for these sixteen, twice the cost
        # of decoding the params, for every task claimed.  The instance
        # __init__ would build is built here directly, fields in order.
        task = object.__new__(cls)
        task.__dict__.update(fields)
        return task

    @property
    def claim_key(self) -> ClaimKey:
        """This claim's identity: what ``complete`` and ``fail`` test the row against."""
        return (self.id, self.locked_by, self.attempts, self.started_at)

    @property
    def sort_key(self) -> tuple[int, datetime, int]:
        """The claim order: priority, then run_at, then id."""
        return (self.priority, self.run_at, self.id)


def task_headers(raw: Any) -> dict[str, str]:
    """A ``headers`` column's value (JSON text, bytes, or a decoded dict) as a dict of strings.

    Never raises: headers written around the queue that are not a JSON
    object of strings are no headers, and the task runs as it would without.
    """
    if raw is None:
        return {}
    value = raw
    if isinstance(raw, bytes | bytearray | memoryview):
        value = bytes(raw).decode("utf-8", "replace")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(value, dict):
        return {}
    return {str(key): str(item) for key, item in value.items() if isinstance(item, str)}
