"""Completing many held tasks in one short statement, for PostgreSQL.

The portable `complete_many_statement` spells out each task's claim test
(``id = ... AND locked_by = ... AND ...``, ORed together), so its text and
parameter count grow with the batch: one statement per batch size, too long
for psycopg to cache, planned again on every run.  Here the ids go as one
array and the claims, with their results, as one JSON document, turned back
into rows by ``json_to_recordset`` and joined to the table, so one short
statement serves every batch size and the server plans it once.  Each row is
still written only under its own claim and a live lease.

Why JSON rather than an array per claim column: the driver adapts an array
element by element, and a timestamp element costs it about as much as the
rest of the statement's parameters together; one document built by
``json.dumps`` costs a fraction of that, and the server parses it as fast.
(A batch of one takes the portable statement for one task: binding a value
costs the driver less than binding an array of one.)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    ARRAY,
    JSON,
    BigInteger,
    Integer,
    String,
    Table,
    Text,
    any_,
    bindparam,
    cast,
    column,
    func,
    update,
)
from sqlalchemy.engine import Dialect

from sa_taskqueue.core.model import TaskStatus, has_status
from sa_taskqueue.core.types import UTCDateTime

#: The ids, as an array: what the plan finds the rows by.
HELD_IDS = "held_ids"
#: Each task's claim and result, as a JSON array of objects (`held_claims`).
HELD_CLAIMS = "held_claims"


def complete_from_arrays_statement(table: Table, now_param: str) -> Any:
    """The UPDATE completing every held task named in `HELD_CLAIMS`, each under its own claim test.

    Parameters: `HELD_IDS` and `HELD_CLAIMS` (see `held_claims`),
    ``now_param`` (the lease test's time) and ``finished_now``.  Tasks with
    dependents are left alone (``has_dependents IS NULL``).
    """
    # SQLAlchemy's generic ARRAY and JSON: the dialect that runs the
    # statement (one whose backend has `completes_from_arrays`) renders its own.
    ids = bindparam(HELD_IDS, type_=ARRAY(BigInteger()))
    held = (
        func.json_to_recordset(cast(bindparam(HELD_CLAIMS, type_=Text()), JSON()))
        .table_valued(
            column("id", BigInteger()),
            column("locked_by", String()),
            column("attempts", Integer()),
            column("started_at", UTCDateTime()),
            column("result", Text()),
        )
        .render_derived(name="held", with_types=True)
    )
    return (
        update(table)
        .where(
            # The ids alone first: without them, a plan that walks the lease
            # index joins every running row of every worker to the claims.
            table.c.id == any_(ids),
            table.c.id == held.c.id,
            table.c.locked_by == held.c.locked_by,
            table.c.attempts == held.c.attempts,
            table.c.started_at == held.c.started_at,
            has_status(table, TaskStatus.RUNNING),
            table.c.locked_until > bindparam(now_param, type_=table.c.locked_until.type),
            # Plain tasks only: one that gained a dependent while it ran is
            # written by the workflow path (`sa_taskqueue.strategies.lease`).
            table.c.has_dependents.is_(None),
        )
        .values(
            status=TaskStatus.COMPLETED,
            finished_at=bindparam("finished_now", type_=table.c.finished_at.type),
            locked_until=None,
            result=cast(held.c.result, table.c.result.type),
        )
    )


def held_claims(
    claim_keys: list[tuple[int, str, int, datetime]], results: list[Any], dialect: Dialect
) -> dict[str, Any]:
    """The parameters for ``claim_keys`` (`ClaimedTask.claim_key`) and their results.

    A claim's start goes as ISO 8601 text with its microseconds, which the
    server reads back to the same instant; a naive one is refused, as the
    column's type refuses it.  Results are serialised as the engine
    serialises JSON (its ``json_serializer``, text or UTF-8 bytes); None stays SQL NULL.
    """
    check_start: Callable[[datetime, Dialect], datetime | None] = UTCDateTime().process_bind_param
    dumps: Callable[[Any], str | bytes] = getattr(dialect, "_json_serializer", None) or json.dumps
    # The tasks of one claim share its start: each start is checked and
    # written out once, not once a task (a few µs a task in a batch of 50).
    start_texts: dict[datetime, str | None] = {}
    claims = []
    for (task_id, locked_by, attempts, started_at), result in zip(claim_keys, results, strict=True):
        try:
            start_text = start_texts[started_at]
        except (KeyError, TypeError):  # (TypeError: not a datetime, unhashable; refused below)
            start = check_start(started_at, dialect)
            if start is not None and start.tzinfo is None:
                # (A backend storing naive UTC got it back without its zone.)
                start = start.replace(tzinfo=UTC)
            start_text = start_texts[started_at] = (
                start.astimezone(UTC).isoformat() if start is not None else None
            )
        document = None if result is None else dumps(result)
        claims.append(
            {
                "id": task_id,
                "locked_by": locked_by,
                "attempts": attempts,
                "started_at": start_text,
                # (A serializer may give bytes, as orjson's does: JSON is UTF-8.)
                "result": document.decode() if isinstance(document, bytes) else document,
            }
        )
    return {HELD_IDS: [task_id for task_id, *_ in claim_keys], HELD_CLAIMS: json.dumps(claims)}


__all__ = ["complete_from_arrays_statement", "held_claims"]
