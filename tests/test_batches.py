"""Batches with callbacks: members counted with their outcomes, callbacks enqueued exactly once.

The bookkeeping is driven here through `batches.members_finished` in a
transaction of the test's own (what every final write of a worker runs),
and through real workers in the end-to-end tests; the races hold real row
locks from a second connection.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.schema import CreateTable

import sa_taskqueue as tq
from sa_taskqueue.core.batch_members import add_members_statement
from sa_taskqueue.core.batch_table import batch_table_of
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.features.workflows import batches
from sa_taskqueue.features.workflows.batches import BatchSummary
from tests.app import queue_bind
from tests.backends import Backend
from tests.helpers import MovableClock, run_cli


@dataclass(frozen=True)
class Finished:
    batch_id: int | None
    status: tq.TaskStatus


def make_batch_queue(engine: sa.Engine, clock: MovableClock | None = None) -> tq.TaskQueue:
    queue = tq.TaskQueue(queue_bind(engine), **({} if clock is None else {"clock": clock.now}))

    @queue.task(name="member")
    def member(n: int) -> int:
        return n

    @queue.task(name="done")
    def done(batch: BatchSummary, channel: str = "ops") -> dict[str, Any]:
        return {"batch": batch.as_json(), "channel": channel}

    @queue.task(name="failed_some")
    def failed_some(batch: dict[str, Any]) -> int:
        return int(batch["failed"]) + int(batch["cancelled"])

    @queue.task(name="keyed", unique_by=("batch",))
    def keyed(batch: dict[str, Any]) -> None:
        return None

    @queue.task(name="no_batch_param")
    def no_batch_param(channel: str) -> None:
        return None

    return queue


@pytest.fixture
def bq(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = make_batch_queue(engine)
    yield queue
    queue.close()


def member_ids(engine: sa.Engine, batch_id: int) -> list[int]:
    table = tq.Task.__table__
    with engine.connect() as conn:
        return list(
            conn.scalars(sa.select(table.c.id).where(table.c.batch_id == batch_id).order_by(table.c.id))
        )


def tasks_named(engine: sa.Engine, name: str) -> list[tq.Task]:
    with Session(engine) as session:
        rows = list(session.scalars(sa.select(tq.Task).where(tq.Task.name == name).order_by(tq.Task.id)))
        session.expunge_all()
        return rows


def finish(engine: sa.Engine, batch_id: int, *statuses: tq.TaskStatus) -> None:
    """Count members with these final statuses into the batch, in one committed transaction."""
    with engine.begin() as conn:
        batches.members_finished(conn, tq.Task.__table__, [Finished(batch_id, s) for s in statuses], utcnow())


def test_members_are_counted_across_transactions_and_callbacks_run_once(
    bq: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session:
        batch = bq.batch(
            session,
            "nightly",
            on_success=bq.registered("done"),
            on_complete=(bq.registered("done"), {"channel": "all"}),
        )
        assert isinstance(batch, tq.Batch)
        batch.enqueue("member", n=1)
        batch.enqueue(bq.registered("member").using(priority=5), n=2)
        session.commit()
        batch_id = batch.id
    with Session(engine) as session:
        later = bq.get_batch(session, batch_id)
        assert isinstance(later, tq.Batch)
        later.enqueue_many("member", [{"n": 3}, {"n": 4}])
        bq.enqueue(session, "member", {"n": 5}, batch=later)
        session.commit()
    state = bq.batch_state(batch_id)
    assert (state.name, state.total, state.pending, state.status) == ("nightly", 5, 5, "open")
    assert len(member_ids(engine, batch_id)) == 5

    finish(engine, batch_id, *[tq.TaskStatus.COMPLETED] * 5)
    assert bq.batch_state(batch_id).status == "open"  # not closed: more members may come
    assert tasks_named(engine, "done") == []

    with Session(engine) as session:
        batch = bq.get_batch(session, batch_id)
        assert isinstance(batch, tq.Batch)
        assert batch.close() is True  # every member had finished: the close finishes it
        assert batch.close() is False
        session.commit()

    state = bq.batch_state(batch_id)
    assert (state.status, state.outcome, state.succeeded, state.pending) == ("finished", "succeeded", 5, 0)
    callbacks = tasks_named(engine, "done")
    assert len(callbacks) == 2
    summary = {"id": batch_id, "name": "nightly", "total": 5, "succeeded": 5, "failed": 0, "cancelled": 0}
    assert sorted(c.params.get("channel", "ops") for c in callbacks) == ["all", "ops"]
    assert all(c.params["batch"] == summary for c in callbacks)
    assert all(c.status == tq.TaskStatus.QUEUED for c in callbacks)


def test_the_last_member_to_finish_enqueues_the_failure_callbacks(
    bq: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session:
        with bq.batch(
            session, on_success=bq.registered("done"), on_failure=bq.registered("failed_some")
        ) as batch:
            assert isinstance(batch, tq.Batch)
            batch.enqueue_many("member", [{"n": n} for n in range(3)])
        session.commit()
    assert bq.batch_state(batch.id).status == "closed"
    finish(engine, batch.id, tq.TaskStatus.COMPLETED, tq.TaskStatus.FAILED)
    assert tasks_named(engine, "failed_some") == []
    finish(engine, batch.id, tq.TaskStatus.CANCELLED)
    state = bq.batch_state(batch.id)
    assert (state.status, state.outcome) == ("finished", "failed")
    assert (state.succeeded, state.failed, state.cancelled) == (1, 1, 1)
    assert tasks_named(engine, "done") == []
    [callback] = tasks_named(engine, "failed_some")
    assert callback.params["batch"]["failed"] == 1


def test_a_closed_batch_takes_no_member_and_nothing_is_written(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        batch = bq.batch(session)
        assert isinstance(batch, tq.Batch)
        batch.enqueue("member", n=1)
        batch.close()
        session.commit()
        with pytest.raises(tq.BatchClosed, match=f"batch {batch.id} is closed"):
            batch.enqueue("member", n=2)
        # The refused row left the session: the transaction goes on, and commits without it.
        bq.enqueue(session, "member", {"n": 20})
        session.commit()
        with pytest.raises(tq.BatchClosed):
            batch.enqueue_many("member", [{"n": 3}, {"n": 4}])
        session.add(tq.Task(name="member", params={"n": 5}, batch_id=batch.id))
        with pytest.raises(tq.BatchClosed):
            session.flush()
        session.rollback()
        # The transaction was left usable: an enqueue outside the batch goes on.
        bq.enqueue(session, "member", {"n": 6})
        session.commit()
    assert len(member_ids(engine, batch.id)) == 1
    assert bq.batch_state(batch.id).total == 1
    with Session(engine) as session, pytest.raises(tq.BatchNotFound):
        bq.enqueue(session, "member", {"n": 7}, batch=batch.id + 1000)


def test_a_refused_bulk_member_leaves_the_transaction_as_it_was(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        open_batch = bq.batch(session)
        closed = bq.batch(session)
        assert isinstance(open_batch, tq.Batch) and isinstance(closed, tq.Batch)
        closed.close()
        open_batch.enqueue("member", n=1)
        with pytest.raises(tq.BatchClosed):
            closed.enqueue_many("member", [{"n": 2}])
        session.commit()  # what came before the refusal is kept, and nothing of it
    assert bq.batch_state(open_batch.id).total == 1
    assert bq.batch_state(closed.id).total == 0
    assert len(member_ids(engine, closed.id)) == 0


def test_session_add_counts_rows_with_a_batch_id(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        batch = bq.batch(session)
        assert isinstance(batch, tq.Batch)
        session.add_all([tq.Task(name="member", params={"n": n}, batch_id=batch.id) for n in range(3)])
        batch.add(tq.Task(name="member", params={"n": 9}))
        session.add(tq.Task(name="member", params={"n": 10}, batch_id=batch.id, unique_key="k"))
        with pytest.raises(ValueError, match="a batch member cannot have a unique key"):
            session.flush()
        session.expunge_all()
        session.commit()
        assert bq.batch_state(batch.id).total == 4
        row = session.scalars(sa.select(tq.Task).where(tq.Task.batch_id == batch.id)).first()
        assert row is not None
        row.batch_id = None
        with pytest.raises(ValueError, match="batch_id is fixed"):
            session.flush()
        session.rollback()


def test_an_empty_closed_batch_finishes_at_once(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        with bq.batch(session, on_success=bq.registered("done")) as batch:
            pass
        session.commit()
    state = bq.batch_state(batch.id)
    assert (state.total, state.status, state.outcome) == (0, "finished", "succeeded")
    assert len(tasks_named(engine, "done")) == 1


def test_a_rolled_back_batch_leaves_nothing(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        with bq.batch(session, on_success=bq.registered("done")) as batch:
            batch.enqueue("member", n=1)
        session.rollback()
    with pytest.raises(tq.BatchNotFound):
        bq.batch_state(batch.id)
    assert tasks_named(engine, "member") == []


def test_callbacks_are_checked_when_the_batch_is_opened(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    done = bq.registered("done")
    assert done is not None
    with Session(engine) as session:
        with pytest.raises(TypeError, match="params do not fit task 'no_batch_param'"):
            bq.batch(session, on_success=(bq.registered("no_batch_param"), {"channel": "x"}))
        with pytest.raises(TypeError, match="params do not fit task 'done'"):
            bq.batch(session, on_success=(done, {"nope": 1}))
        with pytest.raises(ValueError, match="'batch' is the batch's own"):
            bq.batch(session, on_success=(done, {"batch": 1}))
        with pytest.raises(ValueError, match="unique key"):
            bq.batch(session, on_failure=bq.registered("keyed"))
        with pytest.raises(ValueError, match="give it a delay, not a run_at"):
            bq.batch(session, on_complete=done.using(run_at=utcnow()))
        with pytest.raises(TypeError, match="a callback is a registered task"):
            bq.batch(session, on_complete=print)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="a batch member cannot have a unique key"):
            bq.enqueue(session, "member", {"n": 1}, unique_key="k", batch=1)
        assert (
            session.execute(
                sa.select(sa.func.count()).select_from(batch_table_of(tq.Task.__table__))
            ).scalar()
            == 0
        )


def test_a_callback_keeps_its_options_and_gets_its_batch_typed(engine: sa.Engine) -> None:
    clock = MovableClock()
    queue = make_batch_queue(engine, clock)
    done = queue.registered("done")
    assert done is not None
    with Session(engine) as session:
        with queue.batch(
            session, "typed", on_success=done.using(queue="ops", priority=7, delay=timedelta(minutes=5))
        ) as batch:
            batch.enqueue("member", n=1)
        session.commit()
    finish(engine, batch.id, tq.TaskStatus.COMPLETED)
    [callback] = tasks_named(engine, "done")
    assert (callback.queue, callback.priority) == ("ops", 7)
    assert callback.run_at > utcnow() + timedelta(minutes=4)
    # The worker calls it with a BatchSummary, as its annotation asks.
    called = done.call_params(callback.params)
    assert called["batch"] == BatchSummary(batch.id, "typed", 1, 1, 0, 0)
    assert called["batch"].all_succeeded
    queue.close()


def test_two_last_members_finishing_at_once_enqueue_the_callback_once(
    bq: tq.TaskQueue, engine: sa.Engine, backend: Backend
) -> None:
    """The first finisher's transaction held open while the second finishes: one callback."""
    with Session(engine) as session:
        with bq.batch(session, on_complete=bq.registered("done")) as batch:
            batch.enqueue_many("member", [{"n": 1}, {"n": 2}])
        session.commit()
    table = tq.Task.__table__
    first = engine.connect()
    first.begin()
    batches.members_finished(first, table, [Finished(batch.id, tq.TaskStatus.COMPLETED)], utcnow())
    second_done = threading.Event()
    errors: list[BaseException] = []

    def second() -> None:
        try:
            finish(engine, batch.id, tq.TaskStatus.FAILED)
        except BaseException as error:  # noqa: BLE001 (reported by the test)
            errors.append(error)
        second_done.set()

    thread = threading.Thread(target=second)
    thread.start()
    # The second waits on the batch row the first holds (SQLite: on its one writer).
    assert not second_done.wait(0.5)
    first.commit()
    first.close()
    thread.join(30)
    assert not errors, errors
    state = bq.batch_state(batch.id)
    assert (state.succeeded, state.failed, state.status) == (1, 1, "finished")
    assert len(tasks_named(engine, "done")) == 1


def test_a_close_racing_the_last_member_finishes_the_batch_once(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        batch = bq.batch(session, on_complete=bq.registered("done"))
        assert isinstance(batch, tq.Batch)
        batch.enqueue("member", n=1)
        session.commit()
    table = tq.Task.__table__
    member = engine.connect()
    member.begin()
    batches.members_finished(member, table, [Finished(batch.id, tq.TaskStatus.COMPLETED)], utcnow())
    closed: list[bool] = []

    def close() -> None:
        with Session(engine) as session:
            handle = bq.get_batch(session, batch.id)
            assert isinstance(handle, tq.Batch)
            closed.append(handle.close())
            session.commit()

    thread = threading.Thread(target=close)
    thread.start()
    thread.join(0.5)
    member.commit()
    member.close()
    thread.join(30)
    assert closed == [True]  # the close came last, saw the member counted, and finished the batch
    assert len(tasks_named(engine, "done")) == 1


def test_batches_are_listed_newest_first(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    ids = []
    with Session(engine) as session:
        for n in range(3):
            batch = bq.batch(session, f"b{n}")
            assert isinstance(batch, tq.Batch)
            ids.append(batch.id)
        bq.get_batch(session, ids[0]).close()  # type: ignore[union-attr]
        session.commit()
    assert [b.id for b in bq.batches()] == ids[::-1]
    assert [b.id for b in bq.batches(limit=1, before=ids[2])] == [ids[1]]
    assert [b.id for b in bq.batches(unfinished=True)] == ids[:0:-1]
    assert bq.batch_state(ids[0]).as_json()["status"] == "finished"
    with pytest.raises(tq.BatchNotFound, match="no batch with id"):
        bq.batch_state(ids[2] + 1)


# The command line -----------------------------------------------------------------------------


def test_the_command_line_lists_batches_and_shows_one(
    bq: tq.TaskQueue, engine: sa.Engine, backend: Backend
) -> None:
    with Session(engine) as session:
        with bq.batch(session, "reports", on_failure=(bq.registered("done"), {"channel": "#ops"})) as batch:
            batch.enqueue_many("member", [{"n": n} for n in range(3)])
        still_open = bq.batch(session, "open one")
        assert isinstance(still_open, tq.Batch)
        session.commit()
    finish(engine, batch.id, tq.TaskStatus.COMPLETED, tq.TaskStatus.FAILED)

    listed = run_cli("batches", "--json", url=backend.url)
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [row["id"] for row in rows] == [still_open.id, batch.id]
    assert rows[1] | {"created_at": None} == rows[1] | {
        "name": "reports",
        "status": "closed",
        "outcome": None,
        "total": 3,
        "succeeded": 1,
        "failed": 1,
        "cancelled": 0,
        "pending": 1,
        "created_at": None,
    }
    table = run_cli("batches", url=backend.url, COLUMNS="200")
    assert table.returncode == 0, table.stderr
    assert "reports" in table.stdout and "open one" in table.stdout

    shown = run_cli("batch", str(batch.id), "--json", url=backend.url)
    assert shown.returncode == 0, shown.stderr
    one = json.loads(shown.stdout)
    assert one["members"] == {"queued": 3}  # the test counted outcomes without running the members
    assert one["callbacks"] == [
        {
            "on": "failure",
            "name": "done",
            "queue": "default",
            "priority": 0,
            "max_attempts": 3,
            "params": {"channel": "#ops"},
        }
    ]
    text = run_cli("batch", str(batch.id), url=backend.url, COLUMNS="200")
    assert text.returncode == 0, text.stderr
    assert "pending" in text.stdout and "#ops" in text.stdout

    missing = run_cli("batch", str(still_open.id + 100), url=backend.url)
    assert missing.returncode == 1
    assert f"no batch {still_open.id + 100}" in missing.stderr


def test_a_retried_member_leaves_its_count_and_is_counted_again(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        with bq.batch(session, on_complete=bq.registered("done")) as batch:
            batch.enqueue_many("member", [{"n": 1}, {"n": 2}])
        session.commit()
    table = tq.Task.__table__
    first, second = member_ids(engine, batch.id)
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == first).values(status=tq.TaskStatus.FAILED))
        batches.members_finished(conn, table, [Finished(batch.id, tq.TaskStatus.FAILED)], utcnow())
    assert bq.batch_state(batch.id).failed == 1
    assert Admin(engine, table).retry(first) == 1
    state = bq.batch_state(batch.id)
    assert (state.failed, state.pending) == (0, 2)
    with engine.begin() as conn:
        conn.execute(
            sa.update(table).where(table.c.id.in_([first, second])).values(status=tq.TaskStatus.COMPLETED)
        )
        batches.members_finished(conn, table, [Finished(batch.id, tq.TaskStatus.COMPLETED)] * 2, utcnow())
    state = bq.batch_state(batch.id)
    assert (state.succeeded, state.failed, state.outcome) == (2, 0, "succeeded")
    assert len(tasks_named(engine, "done")) == 1


@pytest.mark.async_path
def test_an_async_session_opens_fills_and_closes_a_batch(engine: sa.Engine, backend: Backend) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.pool import NullPool

    from tests.backends import ASYNC_DRIVERS, async_url

    async_engine = create_async_engine(
        async_url(backend.url, ASYNC_DRIVERS[backend.name][0]), poolclass=NullPool
    )
    queue = make_batch_queue(engine)
    done = queue.registered("done")

    async def main() -> int:
        async with AsyncSession(async_engine) as session:
            batch = await queue.batch(session, "async", on_success=done)  # type: ignore[misc]
            await batch.enqueue("member", n=1)
            await batch.enqueue_many("member", [{"n": 2}])
            await queue.enqueue(session, "member", {"n": 3}, batch=batch)
            assert (await batch.state()).total == 3
            assert await batch.close() is False
            await session.commit()
            return int(batch.id)

    batch_id = asyncio.run(main())

    async def closed_by_async_with() -> int:
        async with AsyncSession(async_engine) as session:
            with pytest.raises(TypeError, match="async with"), await queue.batch(session, "plain with"):  # type: ignore[misc]
                pass
            await session.rollback()
            async with await queue.batch(session, "async with", on_success=done) as batch:  # type: ignore[misc]
                await batch.enqueue("member", n=4)
            await session.commit()
            return int(batch.id)

    closed_id = asyncio.run(closed_by_async_with())
    asyncio.run(async_engine.dispose())
    assert queue.batch_state(closed_id).closed_at is not None, "the async with closed it"
    assert queue.batch_state(batch_id).total == 3
    finish(engine, batch_id, *[tq.TaskStatus.COMPLETED] * 3)
    assert len(tasks_named(engine, "done")) == 1
    queue.close()


# Compiled SQL (no server: Oracle and MySQL 8 are checked here) ---------------------------------


@pytest.mark.parametrize(
    "dialect",
    [oracle.dialect(), mysql.dialect(), postgresql.dialect(), sqlite.dialect()],
    ids=["oracle", "mysql", "postgresql", "sqlite"],
)
def test_the_batch_statements_compile_to_one_conditional_update_each(dialect: sa.engine.Dialect) -> None:
    batches_table = batch_table_of(tq.Task.__table__)
    now = utcnow()

    def sql(statement: Any) -> str:
        return " ".join(str(statement.compile(dialect=dialect)).split())

    finish = sql(batches.finish_statement(batches_table, 7, now))
    b = "sa_taskqueue_task_batches"
    assert re.fullmatch(
        rf"UPDATE {b} SET finished_at=.+? WHERE {b}.id = .+? AND {b}.closed_at IS NOT NULL "
        rf"AND {b}.finished_at IS NULL AND {b}.succeeded \+ {b}.failed \+ {b}.cancelled = {b}.total",
        finish,
    ), finish
    counts = sql(batches.count_statement(batches_table, 7, {"succeeded": 3, "failed": 1}))
    assert counts.startswith(
        "UPDATE sa_taskqueue_task_batches SET succeeded=(sa_taskqueue_task_batches.succeeded + "
    )
    added = sql(add_members_statement(batches_table, 7, 1000))
    assert added.endswith("AND sa_taskqueue_task_batches.closed_at IS NULL"), added
    ddl = " ".join(str(CreateTable(batches_table).compile(dialect=dialect)).split())
    if dialect.name == "oracle":
        assert "GENERATED BY DEFAULT AS IDENTITY" in ddl, ddl
        # The new batch's id comes back with the INSERT: RETURNING ... INTO on Oracle.
        insert = sql(sa.insert(batches_table).values(created_at=now).return_defaults(batches_table.c.id))
        assert insert.endswith("RETURNING sa_taskqueue_task_batches.id INTO :ret_0"), insert
    listing = sql(sa.select(batches_table).order_by(batches_table.c.id.desc()).limit(50))
    assert ("FETCH FIRST" in listing) if dialect.name == "oracle" else ("LIMIT" in listing), listing


def test_a_tasks_own_enqueue_takes_batch_and_a_member_cancelled_at_insert_is_counted(
    bq: tq.TaskQueue, engine: sa.Engine
) -> None:
    member = bq.registered("member")
    assert member is not None
    table = tq.Task.__table__
    with Session(engine) as session:
        parent = member.enqueue(session, n=0)
        session.commit()
        parent_id = parent.id
    with engine.begin() as conn:
        conn.execute(sa.update(table).where(table.c.id == parent_id).values(status=tq.TaskStatus.FAILED))
    with Session(engine) as session:
        batch = bq.batch(session, on_failure=bq.registered("failed_some"))
        assert isinstance(batch, tq.Batch)
        member.enqueue(session, n=1, batch=batch)
        member.using(priority=3).enqueue(session, n=2, batch=batch.id)
        # Its parent failed already: it is cancelled as it is inserted, and counted so at once.
        doomed = member.enqueue(session, n=3, batch=batch, depends_on=[parent_id])
        assert doomed.status == tq.TaskStatus.CANCELLED
        member.using(depends_on=[parent_id]).enqueue_many(session, [{"n": 4}, {"n": 5}], batch=batch)
        batch.close()
        session.commit()
    state = bq.batch_state(batch.id)
    assert (state.total, state.cancelled, state.pending) == (5, 3, 2)
    assert member_statuses_of(engine, batch.id) == {"queued": 2, "cancelled": 3}
    finish(engine, batch.id, tq.TaskStatus.COMPLETED, tq.TaskStatus.COMPLETED)
    [callback] = tasks_named(engine, "failed_some")
    assert callback.params["batch"]["cancelled"] == 3


def member_statuses_of(engine: sa.Engine, batch_id: int) -> dict[str, int]:
    with engine.connect() as conn:
        return batches.member_statuses(conn, tq.Task.__table__, batch_id)


def test_a_chain_step_is_a_callback_too(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    done = bq.registered("done")
    assert done is not None
    with Session(engine) as session:
        with bq.batch(session, on_success=done.using(priority=4).call(channel="#steps")) as batch:
            pass
        session.commit()
    [callback] = tasks_named(engine, "done")
    assert (callback.priority, callback.params["channel"], callback.params["batch"]["id"]) == (
        4,
        "#steps",
        batch.id,
    )


def test_a_member_refused_for_a_missing_parent_is_not_counted(bq: tq.TaskQueue, engine: sa.Engine) -> None:
    member = bq.registered("member")
    assert member is not None
    with Session(engine) as session:
        batch = bq.batch(session)
        assert isinstance(batch, tq.Batch)
        batch.enqueue(member, n=1)
        with pytest.raises(tq.ParentNotFound):
            member.enqueue(session, n=2, batch=batch, depends_on=[10**9])
        with pytest.raises(tq.ParentNotFound):
            member.using(depends_on=[10**9]).enqueue_many(session, [{"n": 3}, {"n": 4}], batch=batch)
        batch.close()
        session.commit()
    state = bq.batch_state(batch.id)
    assert (state.total, len(member_ids(engine, batch.id))) == (1, 1)
