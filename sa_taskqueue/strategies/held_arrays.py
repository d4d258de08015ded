"""Completing many held tasks from one array per claim column, for databases with ``unnest``.

The portable `complete_many_statement` spells out each task's claim test
(``id = ... AND locked_by = ... AND ...``, ORed together), so its text and
parameter count grow with the batch: one statement per batch size, too long
for psycopg to cache, planned again on every run.  Here the claims go as five
arrays, zipped back into rows by ``unnest`` and joined to the table, so one
short statement serves every batch size and the server plans it once.  Each
row is still written only under its own claim and a live lease.  (A batch of
one takes the portable statement for one task: binding a value costs the
driver less than binding an array of one.)
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import BigInteger, Integer, String, Table, any_, bindparam, func, update
from sqlalchemy.dialects.postgresql import ARRAY

from sa_taskqueue.model import TaskStatus, has_status
from sa_taskqueue.types import UTCDateTime

#: The array parameters, in the order of the rows' columns.
HELD_IDS = "held_ids"
HELD_BYS = "held_bys"
HELD_ATTEMPTS_LIST = "held_attempts_list"
HELD_STARTS = "held_starts"
HELD_RESULTS = "held_results"


def complete_from_arrays_statement(table: Table, now_param: str) -> Any:
    """The UPDATE completing every held task named by the arrays, each under its own claim test.

    Parameters: `HELD_IDS`, `HELD_BYS`, `HELD_ATTEMPTS_LIST`, `HELD_STARTS`
    and `HELD_RESULTS` (lists of one length), ``now_param`` (the lease
    test's time) and ``finished_now``.
    """
    ids = bindparam(HELD_IDS, type_=ARRAY(BigInteger()))
    held = (
        func.unnest(
            ids,
            bindparam(HELD_BYS, type_=ARRAY(String())),
            bindparam(HELD_ATTEMPTS_LIST, type_=ARRAY(Integer())),
            bindparam(HELD_STARTS, type_=ARRAY(UTCDateTime())),
            bindparam(HELD_RESULTS, type_=ARRAY(table.c.result.type)),
        )
        .table_valued("id", "locked_by", "attempts", "started_at", "result")
        .render_derived()
        .alias("held")
    )
    return (
        update(table)
        .where(
            # The ids alone first: without them, a plan that walks the lease
            # index joins every running row of every worker to the arrays.
            table.c.id == any_(ids),
            table.c.id == held.c.id,
            table.c.locked_by == held.c.locked_by,
            table.c.attempts == held.c.attempts,
            table.c.started_at == held.c.started_at,
            has_status(table, TaskStatus.RUNNING),
            table.c.locked_until > bindparam(now_param, type_=table.c.locked_until.type),
        )
        .values(
            status=TaskStatus.COMPLETED,
            finished_at=bindparam("finished_now", type_=table.c.finished_at.type),
            locked_until=None,
            result=held.c.result,
        )
    )


def held_arrays(claim_keys: list[tuple[int, str, int, Any]], results: list[Any]) -> dict[str, list[Any]]:
    """The array parameters for ``claim_keys`` (`ClaimedTask.claim_key`) and their results."""
    ids, bys, attempts, starts = (list(column) for column in zip(*claim_keys, strict=True))
    return {
        HELD_IDS: ids,
        HELD_BYS: bys,
        HELD_ATTEMPTS_LIST: attempts,
        HELD_STARTS: starts,
        HELD_RESULTS: list(results),
    }


__all__ = ["complete_from_arrays_statement", "held_arrays"]
