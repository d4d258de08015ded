"""The final writes of claimed tasks, routed through the workflow bookkeeping where a task needs it.

A task that belonged to a batch or had dependents when it was claimed
(`ClaimedTask.in_workflow`) is written by the strategy's workflow path: its
fenced UPDATE and `bookkeeping.after_final` in one transaction.  Every other
task is written by the plain fenced UPDATE, which leaves alone a task that
gained a dependent while it ran (``has_dependents IS NULL`` in its guard).
Only when a plain write wrote fewer tasks than it was given (rare: a lost
lease, or that race) are the missing ones read again, and those still
running with dependents are written through the workflow path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, Table, select

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.finished import FinishedTask
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus, has_status
from sa_taskqueue.features.workflows.bookkeeping import after_final
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.lease import Then


def bookkeeping(table: Table, tasks: Sequence[ClaimedTask], statuses: Sequence[Any], now: datetime) -> Then:
    """What a workflow path runs after its fenced write: `after_final` for the tasks it wrote final."""
    by_id = {task.id: (task, status) for task, status in zip(tasks, statuses, strict=True)}

    def then(conn: Connection, written: set[int]) -> None:
        finished = [
            FinishedTask(task.id, TaskStatus(status), task.batch_id, True if task.has_dependents else None)
            for task_id in sorted(written)
            for task, status in [by_id[task_id]]
            if status in FINISHED_STATUSES
        ]
        if finished:
            after_final(conn, table, finished, now)

    return then


def gained_dependents(conn: Connection, table: Table, tasks: Sequence[ClaimedTask]) -> list[ClaimedTask]:
    """Of ``tasks`` (a plain final write did not write them), those still running that now have dependents."""
    if not tasks:
        return []
    found = set(
        conn.scalars(
            select(table.c.id)
            .where(
                table.c.id.in_(sorted(task.id for task in tasks)),
                has_status(table, TaskStatus.RUNNING, indexed=False),
                table.c.has_dependents.is_not(None),
            )
            # A locking read reads the rows as they are now: on MySQL and MariaDB a plain
            # read in a transactional task's REPEATABLE READ transaction would read them as
            # they were at its first read, before the dependent that refused the write.
            .with_for_update()
        )
    )
    return [dataclasses.replace(task, has_dependents=True) for task in tasks if task.id in found]


def read_gained(engine: Engine, table: Table, tasks: Sequence[ClaimedTask]) -> list[ClaimedTask]:
    """`gained_dependents`, on a connection of its own."""
    if not tasks:
        return []
    with engine.connect() as conn:
        return gained_dependents(conn, table, tasks)


def finish(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    task: ClaimedTask,
    values: Mapping[str, Any],
    now: datetime,
) -> bool:
    """`ClaimStrategy.finish`, through the workflow path where the task needs it; True if written."""
    status = values.get("status")
    if status not in FINISHED_STATUSES:
        return strategy.finish(engine, table, task, values, now)
    if not task.in_workflow:
        if strategy.finish(engine, table, task, values, now):
            return True
        gained = read_gained(engine, table, [task])
        if not gained:
            strategy.settled(task)  # (taken over: what else held it goes)
            return False
        task = gained[0]
    then = bookkeeping(table, [task], [status], now)
    return strategy.finish_then(engine, table, task, values, now, then)


def complete_many(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    tasks: Sequence[ClaimedTask],
    results: Sequence[Any],
    now: datetime,
) -> set[int]:
    """`ClaimStrategy.complete_many`, the workflow tasks through the workflow path; the ids written."""
    plain = [index for index, task in enumerate(tasks) if not task.in_workflow]
    if len(plain) == len(tasks):
        written = strategy.complete_many(engine, table, tasks, results, now)
        return written | complete_rerouted(strategy, engine, table, tasks, results, now, written)
    written = set()
    if plain:
        plain_tasks = [tasks[index] for index in plain]
        plain_results = [results[index] for index in plain]
        written = strategy.complete_many(engine, table, plain_tasks, plain_results, now)
        written |= complete_rerouted(strategy, engine, table, plain_tasks, plain_results, now, written)
    flow = [index for index, task in enumerate(tasks) if task.in_workflow]
    return written | complete_workflow(
        strategy, engine, table, [tasks[index] for index in flow], [results[index] for index in flow], now
    )


def complete_workflow(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    tasks: Sequence[ClaimedTask],
    results: Sequence[Any],
    now: datetime,
) -> set[int]:
    """Complete workflow tasks through the workflow path, all in one transaction; the ids written."""
    if not tasks:
        return set()
    then = bookkeeping(table, tasks, [TaskStatus.COMPLETED] * len(tasks), now)
    return strategy.complete_many_then(engine, table, tasks, results, now, then)


def complete_rerouted(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    tasks: Sequence[ClaimedTask],
    results: Sequence[Any],
    now: datetime,
    written: set[int],
) -> set[int]:
    """Those of ``tasks`` a plain completion did not write because they gained dependents, completed now."""
    if len(written) == len(tasks):
        return set()
    missing = [index for index, task in enumerate(tasks) if task.id not in written]
    gained = {task.id: task for task in read_gained(engine, table, [tasks[index] for index in missing])}
    again = [index for index in missing if tasks[index].id in gained]
    for index in missing:
        if tasks[index].id not in gained:
            strategy.settled(tasks[index])  # (taken over: what else held it goes)
    return complete_workflow(
        strategy, engine, table, [gained[tasks[i].id] for i in again], [results[i] for i in again], now
    )


def fail_many(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    tasks: Sequence[ClaimedTask],
    values: Sequence[Mapping[str, Any]],
    now: datetime,
) -> set[int]:
    """`ClaimStrategy.fail_many`, the workflow tasks through the workflow path; the ids written."""
    plain = [index for index, task in enumerate(tasks) if not task.in_workflow]
    flow = [index for index, task in enumerate(tasks) if task.in_workflow]
    written: set[int] = set()
    if plain:
        plain_tasks = [tasks[index] for index in plain]
        written = strategy.fail_many(engine, table, plain_tasks, [values[index] for index in plain], now)
        if len(written) < len(plain):
            missing = [index for index in plain if tasks[index].id not in written]
            gained = {task.id: task for task in read_gained(engine, table, [tasks[i] for i in missing])}
            rerouted = [index for index in missing if tasks[index].id in gained]
            for index in missing:
                if tasks[index].id not in gained:
                    strategy.settled(tasks[index])  # (taken over: what else held it goes)
            written |= _fail_workflow(
                strategy,
                engine,
                table,
                [gained[tasks[index].id] for index in rerouted],
                [values[index] for index in rerouted],
                now,
            )
    return written | _fail_workflow(
        strategy, engine, table, [tasks[index] for index in flow], [values[index] for index in flow], now
    )


def _fail_workflow(
    strategy: ClaimStrategy,
    engine: Engine,
    table: Table,
    tasks: Sequence[ClaimedTask],
    values: Sequence[Mapping[str, Any]],
    now: datetime,
) -> set[int]:
    if not tasks:
        return set()
    then = bookkeeping(table, tasks, [row["status"] for row in values], now)
    return strategy.fail_many_then(engine, table, tasks, values, now, then)


def complete_on(
    strategy: ClaimStrategy,
    conn: Connection,
    table: Table,
    task: ClaimedTask,
    values: Mapping[str, Any],
    now: datetime,
) -> bool:
    """`ClaimStrategy.complete_on` (a transactional task's completion), with the bookkeeping on ``conn``.

    All in the caller's transaction: its rollback undoes the release of the
    dependents and the batch's count with the completion.
    """
    if not task.in_workflow:
        if strategy.complete_on(conn, table, task, values, now):
            return True
        gained = gained_dependents(conn, table, [task])
        if not gained:
            return False
        task = gained[0]
    if not strategy.complete_on(conn, table, task, values, now, workflow=True):
        return False
    bookkeeping(table, [task], [values["status"]], now)(conn, {task.id})
    return True


__all__ = [
    "bookkeeping",
    "complete_many",
    "complete_on",
    "complete_workflow",
    "fail_many",
    "finish",
    "gained_dependents",
]
