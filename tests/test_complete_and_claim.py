"""`complete_many_and_claim`: a batch's successes written and the next claimed, at once where they can be."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import MovableClock, statements_sent, task_row
from tests.helpers import enqueue_records as enqueue
from tests.test_claim import a_claim_lost_and_a_claim_kept


def updates_of_tasks(queue: tq.TaskQueue) -> AbstractContextManager[list[str]]:
    """The statements writing the task table that the queue sends meanwhile."""
    return statements_sent(queue, lambda sql: "UPDATE" in sql.upper() and tq.Task.__tablename__ in sql)


def test_it_writes_each_success_with_its_result_and_claims_the_next_in_claim_order(
    clocked_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    queue = clocked_queue
    first_id, second_id, *rest = enqueue(queue, engine, 5)
    held = queue.claim(limit=2, worker_id="w")
    assert [task.id for task in held] == [first_id, second_id]
    written, claimed = queue.complete_many_and_claim(held, [{"n": 1}, None], limit=2, worker_id="w")
    assert written == {first_id, second_id}
    assert [task.id for task in claimed] == rest[:2]
    assert {(task.attempts, task.locked_by) for task in claimed} == {(1, "w")}
    first, second = task_row(engine, first_id), task_row(engine, second_id)
    assert (first.status, first.result, first.locked_until) == (tq.TaskStatus.COMPLETED, {"n": 1}, None)
    assert (second.status, second.result) == (tq.TaskStatus.COMPLETED, None)
    for task in claimed:
        row = task_row(engine, task.id)
        assert (row.status, row.locked_by, row.attempts) == (tq.TaskStatus.RUNNING, "w", 1)
    assert task_row(engine, rest[2]).status == tq.TaskStatus.QUEUED


def test_it_writes_only_the_tasks_still_held_and_claims_all_the_same(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    queue = clocked_queue
    lost, _new_holder, kept = a_claim_lost_and_a_claim_kept(queue, engine, strategy_name, lease, clock)
    [next_id] = enqueue(queue, engine, 1)
    written, claimed = queue.complete_many_and_claim(
        [lost, kept], ["stale", "kept"], limit=3, worker_id="first"
    )
    assert written == {kept.id}
    assert [task.id for task in claimed] == [next_id]
    lost_row = task_row(engine, lost.id)
    assert (lost_row.status, lost_row.locked_by, lost_row.result) == (tq.TaskStatus.RUNNING, "second", None)
    assert task_row(engine, kept.id).result == "kept"


def test_with_nothing_to_complete_it_claims_and_with_nothing_due_it_completes(
    clocked_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    queue = clocked_queue
    [only_id] = enqueue(queue, engine, 1)
    written, claimed = queue.complete_many_and_claim([], limit=5, worker_id="w")
    assert (written, [task.id for task in claimed]) == (set(), [only_id])
    written, claimed = queue.complete_many_and_claim(claimed, ["done"], limit=5, worker_id="w")
    assert (written, claimed) == ({only_id}, [])
    assert task_row(engine, only_id).result == "done"


def test_it_claims_only_the_queues_and_names_asked_for_and_none_of_a_paused_queue(
    clocked_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    queue = clocked_queue
    [held_id] = enqueue(queue, engine, 1)
    [held] = queue.claim(worker_id="w")
    with Session(engine) as session:
        elsewhere_id = queue.enqueue(session, "record", {"key": 1}, queue="elsewhere").id
        paused_id = queue.enqueue(session, "record", {"key": 2}, queue="paused").id
        other_name_id = queue.enqueue(session, "boom", {"message": "not asked for"}, queue="elsewhere").id
        session.commit()
    queue.pause("paused")
    written, claimed = queue.complete_many_and_claim(
        [held], limit=5, worker_id="w", queues=["elsewhere", "paused"], names=["record"]
    )
    assert written == {held_id}
    assert [task.id for task in claimed] == [elsewhere_id]
    assert {task_row(engine, i).status for i in (paused_id, other_name_id)} == {tq.TaskStatus.QUEUED}
    # Every queue asked for paused: the completion is written, nothing is claimed.
    written, claimed = queue.complete_many_and_claim(claimed, limit=5, worker_id="w", queues=["paused"])
    assert (written, claimed) == ({elsewhere_id}, [])


def test_a_result_that_cannot_be_stored_stops_both_before_anything_is_sent(
    clocked_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    queue = clocked_queue
    first_id, second_id, next_id = enqueue(queue, engine, 3)
    held = queue.claim(limit=2, worker_id="w")
    with pytest.raises(TypeError, match=f"task {second_id}"):
        queue.complete_many_and_claim(held, [1, float("nan")], limit=1, worker_id="w")
    with pytest.raises(ValueError, match="2 tasks"):
        queue.complete_many_and_claim(held, [1], limit=1, worker_id="w")
    with pytest.raises(ValueError, match="limit"):
        queue.complete_many_and_claim(held, limit=0, worker_id="w")
    statuses = {task_id: task_row(engine, task_id).status for task_id in (first_id, second_id, next_id)}
    assert statuses == {
        first_id: tq.TaskStatus.RUNNING,
        second_id: tq.TaskStatus.RUNNING,
        next_id: tq.TaskStatus.QUEUED,
    }


@pytest.mark.backends("postgres")
def test_on_postgresql_a_result_the_database_refuses_leaves_the_next_task_unclaimed(
    clocked_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    # JSON can hold a NUL character; PostgreSQL's jsonb cannot.  One
    # statement: the completion refused, the claim rolls back with it.
    queue = clocked_queue
    held_id, next_id = enqueue(queue, engine, 2)
    [held] = queue.claim(worker_id="w")
    with pytest.raises(tq.DatabaseError):
        queue.complete_many_and_claim([held], ["a\x00b"], limit=1, worker_id="w")
    assert task_row(engine, held_id).status == tq.TaskStatus.RUNNING
    assert task_row(engine, next_id).status == tq.TaskStatus.QUEUED
    assert queue.complete_many_and_claim([held], ["ab"], limit=1, worker_id="w")[0] == {held_id}


def test_on_postgresql_the_two_go_in_one_statement_and_elsewhere_in_two(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, backend: Backend, strategy_name: str
) -> None:
    queue = clocked_queue
    enqueue(queue, engine, 4)
    held = queue.claim(limit=2, worker_id="w")
    with updates_of_tasks(queue) as sent:
        written, claimed = queue.complete_many_and_claim(held, limit=2, worker_id="w")
    assert (len(written), len(claimed)) == (2, 2)
    one_statement = backend.is_postgres and strategy_name == "skip_locked"
    if one_statement:
        assert len(sent) == 1, sent
    else:
        assert len(sent) >= 2, sent


def commits_both_at_once(backend: Backend, strategy_name: str) -> bool:
    """Where a completion and a claim commit together: skip_locked's, and SQLite's one writer at a time.

    (Not on Oracle, whose claim fetches from an unbounded locking cursor.)
    """
    if strategy_name == "skip_locked":
        return backend.name != "oracle"
    return backend.is_sqlite and strategy_name == "conditional_update"


class ClaimFailed(Exception):
    pass


def test_where_both_commit_at_once_a_claim_that_fails_leaves_the_successes_unwritten(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, backend: Backend, strategy_name: str
) -> None:
    queue = clocked_queue
    held_id, next_id = enqueue(queue, engine, 2)
    [held] = queue.claim(worker_id="w")
    at_once = commits_both_at_once(backend, strategy_name)
    assert queue.strategy.completes_and_claims_at_once(queue.engine.dialect) is at_once
    sent_before: list[str] = []

    def fail_the_claim(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        # The connection dies, say, once the completion is sent: the claim's
        # statement never reaches the database.
        if "LIMIT" in statement.upper() or "SKIP LOCKED" in statement.upper():
            raise ClaimFailed(statement)
        sent_before.append(statement)

    queue_engine = getattr(queue.engine, "sync_engine", queue.engine)
    sa.event.listen(queue_engine, "before_cursor_execute", fail_the_claim)
    try:
        with pytest.raises(ClaimFailed):
            queue.complete_many_and_claim([held], ["done"], limit=1, worker_id="w")
    finally:
        sa.event.remove(queue_engine, "before_cursor_execute", fail_the_claim)
    if not (backend.is_postgres and strategy_name == "skip_locked"):  # (there one statement holds both)
        assert any("UPDATE" in sql.upper() for sql in sent_before), "the completion was sent first"
    held_row = task_row(engine, held_id)
    if at_once:
        assert (held_row.status, held_row.result) == (tq.TaskStatus.RUNNING, None), "rolled back"
    else:
        assert (held_row.status, held_row.result) == (tq.TaskStatus.COMPLETED, "done"), "committed on its own"
    assert task_row(engine, next_id).status == tq.TaskStatus.QUEUED
    written, claimed = queue.complete_many_and_claim([held], ["done"], limit=1, worker_id="w")
    assert (written, [task.id for task in claimed]) == (({held_id} if at_once else set()), [next_id])


@pytest.mark.backends("sqlite")
def test_on_sqlite_a_claim_the_database_interrupts_rolls_back_both_and_raises_its_own_error(
    engine: sa.Engine, lease: timedelta, clock: MovableClock
) -> None:
    # SQLite ends the whole transaction itself when a write in it is
    # interrupted; the error raised is the interrupt, not the ROLLBACK after it.
    queue = tq.TaskQueue(engine, strategy="conditional_update", lease=lease, clock=clock.now)
    queue.task(name="record")(lambda key: key)
    held_id, next_id = enqueue(queue, engine, 2)
    [held] = queue.claim(worker_id="w")
    interrupted: list[str] = []

    def interrupt_once() -> int:
        if interrupted:
            return 0
        interrupted.append("claim")
        return 1

    def interrupt_the_claim(conn: sa.Connection, _cursor: object, statement: str, *_rest: object) -> None:
        if "RETURNING" in statement.upper() and "LIMIT" in statement.upper():
            conn.connection.dbapi_connection.set_progress_handler(interrupt_once, 1)  # type: ignore[union-attr]

    sa.event.listen(engine, "before_cursor_execute", interrupt_the_claim)
    try:
        with pytest.raises(tq.DatabaseError, match="interrupted"):
            queue.complete_many_and_claim([held], ["done"], limit=1, worker_id="w")
    finally:
        sa.event.remove(engine, "before_cursor_execute", interrupt_the_claim)
    assert interrupted == ["claim"]
    assert (task_row(engine, held_id).status, task_row(engine, next_id).status) == (
        tq.TaskStatus.RUNNING,
        tq.TaskStatus.QUEUED,
    )
    written, claimed = queue.complete_many_and_claim([held], ["done"], limit=1, worker_id="w")
    assert (written, [task.id for task in claimed]) == ({held_id}, [next_id])
    queue.close()


def test_racing_loops_complete_every_task_once_and_never_claim_one_twice(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    total, loops, batch = 120, 4, 5
    enqueue(queue, engine, total)
    claimed_by: Counter[int] = Counter()
    written_by: Counter[int] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()

    def loop(worker: str) -> None:
        try:
            held = queue.claim(limit=batch, worker_id=worker)
            while held:
                with lock:
                    claimed_by.update(task.id for task in held)
                written, held = queue.complete_many_and_claim(
                    held, [task.id for task in held], limit=batch, worker_id=worker
                )
                with lock:
                    written_by.update(written)
        except BaseException as error:  # noqa: BLE001 - reported by the test below
            errors.append(error)

    threads = [threading.Thread(target=loop, args=(f"w{index}",)) for index in range(loops)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert len(claimed_by) == total and set(claimed_by.values()) == {1}, "each task claimed once"
    assert written_by == claimed_by, "each task completed once, by its claimer"
    with engine.connect() as conn:
        table = tq.Task.__table__
        rows = conn.execute(sa.select(table.c.id, table.c.status, table.c.result, table.c.attempts)).all()
    assert {(row.status, row.attempts) for row in rows} == {(tq.TaskStatus.COMPLETED, 1)}
    assert all(row.result == row.id for row in rows)


def test_a_strategy_that_completes_its_own_way_completes_and_claims_one_after_the_other(
    engine: sa.Engine, lease: timedelta, backend: Backend
) -> None:
    from sa_taskqueue.strategies.base import ClaimStrategy
    from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
    from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy

    completed_its_way: list[int] = []
    # (The strategy that commits both at once on this database, subclassed.)
    at_once: type[ClaimStrategy] = ConditionalUpdateStrategy if backend.is_sqlite else SkipLockedStrategy

    class OwnCompletions(at_once):  # type: ignore[misc,valid-type]
        def complete_many(self, engine: Any, table: Any, tasks: Any, results: Any, now: Any) -> set[int]:
            completed_its_way.extend(task.id for task in tasks)
            return super().complete_many(engine, table, tasks, results, now)

    queue = make_queue(engine, OwnCompletions(), lease)  # type: ignore[arg-type]
    try:
        held_id, next_id = enqueue(queue, engine, 2)
        [held] = queue.claim(worker_id="w")
        with updates_of_tasks(queue) as sent:
            written, claimed = queue.complete_many_and_claim([held], limit=1, worker_id="w")
    finally:
        queue.close()
    assert (written, [task.id for task in claimed]) == ({held_id}, [next_id])
    assert completed_its_way == [held_id]
    assert not queue.strategy.completes_and_claims_at_once(queue.engine.dialect)
    assert len(sent) >= 2, sent
