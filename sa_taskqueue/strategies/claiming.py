"""The SQL every claim shares: which rows are due, in what order, what a claim writes and reads back.

Claim statements are built once per shape and run with bound parameters
(building SQLAlchemy constructs costs more per claim than a round trip does),
so the values a claim varies are named parameters, filled by
`ClaimRequest.params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import BindParameter, ColumnElement, Integer, Select, Table, and_, bindparam, select

from sa_taskqueue.core.claimed_params import params_as_text
from sa_taskqueue.core.model import TaskStatus, has_status

# The claim's parameters (not column names: those are taken by the SET clause's own).
LIMIT = "claim_limit"
NOW = "claim_now"
WORKER = "claim_worker"
LEASE_UNTIL = "claim_lease_until"
QUEUES = "claim_queue"
NAMES = "claim_name"
PAUSED = "claim_paused"


@dataclass(frozen=True)
class ClaimRequest:
    """What a claim asks for: how many tasks, from which queues, for whom, and until when.

    ``names``, when given, restricts the claim to tasks of those names: a
    worker takes only what it has functions for, and leaves a newer
    release's tasks queued for the workers that know them.  ``paused``,
    when given, leaves out the tasks of those queues (`sa_taskqueue.features.pausing`):
    a claim of every queue while some are paused.  None, the usual case,
    keeps the claim's SQL as it is without pauses.
    """

    limit: int
    queues: tuple[str, ...] | None
    worker_id: str
    now: datetime
    lease_until: datetime
    names: tuple[str, ...] | None = None
    paused: tuple[str, ...] | None = None

    def params(self) -> dict[str, Any]:
        """The values of the bound parameters that `due_clause` and `claimed_values` leave open."""
        params: dict[str, Any] = {
            LIMIT: self.limit,
            NOW: self.now,
            WORKER: self.worker_id,
            LEASE_UNTIL: self.lease_until,
        }
        if self.queues is not None:
            params.update(zip(queue_params(len(self.queues)), self.queues, strict=True))
        if self.names is not None:
            params.update(zip(name_params(len(self.names)), self.names, strict=True))
        if self.paused is not None:
            params.update(zip(paused_params(len(self.paused)), self.paused, strict=True))
        return params

    @property
    def shape(self) -> tuple[int | None, int | None, int | None]:
        """What changes the claim's SQL (not just its parameters): how many queues, names, paused."""
        return (
            len(self.queues) if self.queues is not None else None,
            len(self.names) if self.names is not None else None,
            len(self.paused) if self.paused is not None else None,
        )


def queue_params(count: int) -> list[str]:
    """The parameters holding a claim's queue names: one per name, so that the SQL is fixed per count."""
    return [f"{QUEUES}_{index}" for index in range(count)]


def name_params(count: int) -> list[str]:
    """The parameters holding the task names a claim is limited to, one per name."""
    return [f"{NAMES}_{index}" for index in range(count)]


def paused_params(count: int) -> list[str]:
    """The parameters holding the paused queues a claim of every queue leaves out, one per queue."""
    return [f"{PAUSED}_{index}" for index in range(count)]


def due_clause(table: Table, request: ClaimRequest) -> ColumnElement[bool]:
    """Queued, due, and (when asked) in one of the requested queues and of the requested names.

    The values come from `ClaimRequest.params`.
    """
    clause = and_(
        has_status(table, TaskStatus.QUEUED),
        table.c.run_at <= bindparam(NOW, type_=table.c.run_at.type),
    )
    if request.queues is not None:
        names = queue_params(len(request.queues))
        clause = and_(
            clause, table.c.queue.in_([bindparam(name, type_=table.c.queue.type) for name in names])
        )
    if request.names is not None:
        names = name_params(len(request.names))
        clause = and_(clause, table.c.name.in_([bindparam(name, type_=table.c.name.type) for name in names]))
    if request.paused is not None:
        names = paused_params(len(request.paused))
        clause = and_(
            clause, table.c.queue.not_in([bindparam(name, type_=table.c.queue.type) for name in names])
        )
    return clause


def due_select(table: Table, request: ClaimRequest, *columns: Any) -> Select[Any]:
    """Due rows in claim order: what every strategy reads to find work (it adds the limit and locks)."""
    return select(*columns).where(due_clause(table, request)).order_by(*claim_order(table))


def limit_param() -> BindParameter[int]:
    """The claim's row limit, bound at execution."""
    return bindparam(LIMIT, type_=Integer())


def claim_order(table: Table) -> tuple[Any, ...]:
    """Smaller priority first, then earlier run_at, then older id: the order the claim index holds."""
    return (table.c.priority, table.c.run_at, table.c.id)


def claimed_values(table: Table, request: ClaimRequest) -> dict[str, Any]:
    """The columns a claim sets, as SQL (attempts is incremented in the database)."""
    return {
        "status": TaskStatus.RUNNING,
        "attempts": table.c.attempts + 1,
        "started_at": bindparam(NOW, type_=table.c.started_at.type),
        "locked_by": bindparam(WORKER, type_=table.c.locked_by.type),
        "locked_until": bindparam(LEASE_UNTIL, type_=table.c.locked_until.type),
    }


#: The columns a claim reads back of each row it takes.  The rest of a claimed
#: task is what the claim itself wrote, known without asking; and each column
#: read costs the driver and SQLAlchemy a few microseconds a row.
#: ``headers`` too, so that a worker has the trace context a task carries with no statement of its own
#: (NULL, a few bytes on the wire, when the enqueue carried none); and ``batch_id`` and
#: ``has_dependents``, so that a workflow task's final write takes the workflow path at once (NULL
#: for a plain task).
READ_BACK = (
    "id",
    "name",
    "queue",
    "priority",
    "params",
    "attempts",
    "max_attempts",
    "run_at",
    "created_at",
    "headers",
    "batch_id",
    "has_dependents",
)
#: The JSON columns a claim reads as text, decoded by whoever needs them, row by row.
_READ_AS_TEXT = frozenset({"params", "headers"})


def read_back(table: Table) -> list[Any]:
    """The `READ_BACK` columns of ``table``, params and headers as text (each row's decoded on its own)."""
    return [_as_read(table.c[name]) for name in READ_BACK]


def whole_row(table: Table) -> list[Any]:
    """Every column of ``table``, params and headers as text: for strategies that read a claimed row whole."""
    return [_as_read(column) for column in table.c]


def _as_read(column: Any) -> Any:
    return params_as_text(column) if column.key in _READ_AS_TEXT else column


def claimed_row(row: Mapping[str, Any], request: ClaimRequest) -> dict[str, Any]:
    """A row read back after the claim's UPDATE, with the values the claim wrote."""
    claimed = dict(row)
    claimed.update(
        status=TaskStatus.RUNNING,
        started_at=request.now,
        locked_by=request.worker_id,
        locked_until=request.lease_until,
    )
    return claimed


def apply_claim(row: Mapping[str, Any], request: ClaimRequest) -> dict[str, Any]:
    """A row read before the claim's UPDATE, as it is after it (for databases without RETURNING)."""
    claimed = claimed_row(row, request)
    claimed["attempts"] = row["attempts"] + 1
    return claimed


__all__ = [
    "READ_BACK",
    "ClaimRequest",
    "apply_claim",
    "claim_order",
    "claimed_row",
    "claimed_values",
    "due_clause",
    "due_select",
    "limit_param",
    "name_params",
    "paused_params",
    "queue_params",
    "read_back",
    "whole_row",
]
