"""ENQUEUED and CANCELLED: emitted once the transaction that makes them true has committed, never before."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.events import EventKind, TaskEvent


@pytest.fixture
def queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(engine)

    @queue.task(name="note")
    def note(text: str) -> None:
        pass

    @queue.task(name="keyed", unique_by=("key",))
    def keyed(key: int) -> None:
        pass

    yield queue
    queue.close()


@pytest.fixture
def heard(queue: tq.TaskQueue) -> Iterator[list[TaskEvent]]:
    events: list[TaskEvent] = []
    unsubscribe = queue.events.subscribe(events.append, [EventKind.ENQUEUED, EventKind.CANCELLED])
    yield events
    unsubscribe()


def test_an_enqueue_is_announced_when_its_transaction_commits(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        task = queue.enqueue(session, "note", {"text": "hello"}, queue="mail")
        assert heard == [], "not before the commit: the task does not exist for anyone else yet"
        session.commit()
        assert [(e.kind, e.task_id, e.task_name, e.queue, e.attempt) for e in heard] == [
            (EventKind.ENQUEUED, task.id, "note", "mail", 0)
        ]


def test_an_enqueue_rolled_back_is_never_announced(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        queue.enqueue(session, "note", {"text": "lost"})
        session.rollback()
        session.commit()  # a later commit of the same session has nothing to announce
    assert heard == []


def test_an_enqueue_in_a_session_closed_uncommitted_is_never_announced(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    session = Session(engine)
    queue.enqueue(session, "note", {"text": "abandoned"})
    session.close()  # the transaction ends without a commit
    queue.enqueue(session, "note", {"text": "kept"})
    session.commit()
    session.close()
    assert len(heard) == 1


def test_a_savepoint_rolled_back_takes_its_enqueues_with_it(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        kept = queue.enqueue(session, "note", {"text": "kept"}).id
        savepoint = session.begin_nested()
        queue.enqueue(session, "note", {"text": "dropped"})
        savepoint.rollback()
        released = session.begin_nested()
        also_kept = queue.enqueue(session, "note", {"text": "released"}).id
        released.commit()
        assert heard == [], "a savepoint's release is not the commit"
        session.commit()
    assert [event.task_id for event in heard] == [kept, also_kept]


def test_enqueue_many_announces_each_row(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        ids = queue.enqueue_many(session, "note", [{"text": str(n)} for n in range(3)])
        session.commit()
    assert [event.task_name for event in heard] == ["note"] * 3
    # Where the database returns no ids from a multi-row INSERT, the events carry none either.
    assert [event.task_id for event in heard] == (ids if ids is not None else [None] * 3)


def test_a_held_unique_key_announces_nothing_new(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        first = queue.enqueue(session, "keyed", {"key": 1}).id
        session.commit()
        again = queue.enqueue(session, "keyed", {"key": 1}).id
        session.commit()
        assert again == first
        queue.enqueue_many(session, "keyed", [{"key": 1}, {"key": 2}, {"key": 2}])
        session.commit()
    assert [(event.task_name, event.task_id is not None) for event in heard] == [("keyed", True)] * 2
    assert heard[0].task_id == first and heard[1].task_id != first


def test_a_row_the_application_adds_itself_is_not_the_queues_to_announce(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        session.add(tq.Task(name="note", params={"text": "by hand"}))
        session.commit()
    assert heard == []


def test_a_cancel_is_announced_after_it_commits_and_only_when_it_cancelled(
    queue: tq.TaskQueue, engine: sa.Engine, heard: list[TaskEvent]
) -> None:
    with Session(engine) as session:
        task = queue.enqueue(session, "note", {"text": "never"}, queue="mail")
        session.commit()
        task_id = task.id
    heard.clear()
    assert queue.cancel(task_id)
    assert [(e.kind, e.task_id, e.task_name, e.queue) for e in heard] == [
        (EventKind.CANCELLED, task_id, "note", "mail")
    ]
    with Session(engine) as session:
        assert session.get(tq.Task, task_id).status is tq.TaskStatus.CANCELLED  # type: ignore[union-attr]
    assert not queue.cancel(task_id), "no longer queued"
    assert len(heard) == 1


def test_nothing_is_read_for_an_event_nobody_listens_for(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement)

    with Session(engine) as session:
        task = queue.enqueue(session, "note", {"text": "quiet"})
        session.commit()
        task_id = task.id
    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        assert queue.cancel(task_id)
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)
    assert not [s for s in statements if s.lstrip().upper().startswith("SELECT") and "name" in s.lower()]


def test_every_event_is_stamped_by_the_queues_clock(engine: sa.Engine) -> None:
    moment = datetime(2031, 5, 4, 3, 2, 1, tzinfo=UTC)
    queue = tq.TaskQueue(engine, clock=lambda: moment)

    @queue.task(name="note")
    def note(text: str) -> None:
        pass

    heard: list[TaskEvent] = []
    unsubscribe = queue.events.subscribe(heard.append)
    try:
        with Session(engine) as session:
            queue.enqueue(session, "note", {"text": "when"})
            session.commit()
        tq.Worker(queue, burst=True, watchdog=False, poll_interval=0.05).run()
    finally:
        unsubscribe()
        queue.close()
    kinds = {event.kind for event in heard}
    assert {EventKind.ENQUEUED, EventKind.CLAIMED, EventKind.SUCCEEDED, EventKind.WORKER_STOPPED} <= kinds
    assert {event.at for event in heard} == {moment}
