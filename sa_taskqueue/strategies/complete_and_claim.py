"""Completing a worker's batch and claiming its next in one statement, for PostgreSQL.

A worker whose slots finish a batch writes their successes and then claims
tasks for the slots they free: two statements, two round trips, two commits,
and twice SQLAlchemy's and the driver's work on the client.  PostgreSQL runs
data-modifying CTEs of one statement in one snapshot and one transaction, so
here the completion (`complete_from_arrays_statement`, announced as
`announcing` does) and the claim (`SkipLockedStrategy.one_statement_claim`)
are two CTEs of one SELECT: one round trip and one commit for both.

They cannot touch the same rows: the completion writes only rows RUNNING
under the worker's own claims, the claim takes only rows QUEUED in the
snapshot.  Each keeps its own guard: a row is completed only under its own
claim and a live lease, and a row is claimed only if no other claimer holds
its lock.  Either both commit or neither does: a result the database
refuses fails the claim with it, and nothing is claimed.

The SELECT returns one row per task claimed, each with the ids completed
(`FINISHED_IDS`, as `announced_ids` reads them), or a single row of NULLs
but for those ids when nothing was claimed.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Table, select, true

from sa_taskqueue.core.finished import announcing
from sa_taskqueue.strategies.held_arrays import complete_from_arrays_statement

#: The column holding the ids the statement completed, comma-separated.
FINISHED_IDS = "finished_ids"


def complete_and_claim_statement(table: Table, claim: Any, now_param: str) -> Any:
    """One SELECT running the held tasks' completion and ``claim`` (an UPDATE ... RETURNING).

    Parameters: the completion's (`complete_from_arrays_statement`, its
    lease test's time ``now_param``) and the claim's (`ClaimRequest.params`).
    """
    completed = announcing(complete_from_arrays_statement(table, now_param), table).cte("completed")
    claimed = claim.cte("claimed")
    # The completion's one row, joined to each row claimed: a row even when none is.
    return select(completed.c[FINISHED_IDS], *claimed.c).select_from(completed.outerjoin(claimed, true()))


__all__ = ["FINISHED_IDS", "complete_and_claim_statement"]
