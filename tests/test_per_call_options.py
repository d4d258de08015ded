"""``task.using(queue=, priority=, run_at=, delay=, max_attempts=)``: per-call options, checked at once."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import make_queue
from tests.helpers import MovableClock, task_row, task_rows

START = datetime(2030, 6, 1, 12, 0, tzinfo=UTC)


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock(START)


@pytest.fixture
def timed_queue(engine: sa.Engine, clock: MovableClock) -> Iterator[tq.TaskQueue]:
    """The test application's queue, reading the time from ``clock``."""
    queue = make_queue(engine, None, timedelta(minutes=5), clock=clock.now)
    yield queue
    queue.close()


@pytest.fixture
def record(timed_queue: tq.TaskQueue) -> tq.RegisteredTask[Any, Any]:
    registered = timed_queue.registered("record")
    assert registered is not None
    return registered


def test_options_replace_the_registrations_for_that_enqueue_only(
    engine: sa.Engine, record: tq.RegisteredTask[Any, Any]
) -> None:
    run_at = datetime(2031, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=-3)))
    with Session(engine) as session:
        task = record.using(queue="mail", priority=-5, run_at=run_at, max_attempts=9).enqueue(session, key=1)
        assert isinstance(task, tq.Task), "the same as enqueue returns: the flushed row"
        assert task.id is not None
        plain = record.enqueue(session, key=2)
        session.commit()
        ids = (task.id, plain.id)
    with_options, without = (task_row(engine, task_id) for task_id in ids)
    assert (with_options.queue, with_options.priority, with_options.max_attempts) == ("mail", -5, 9)
    assert with_options.run_at == run_at
    assert with_options.params == {"key": 1}
    assert (without.queue, without.priority, without.max_attempts) == ("default", 0, 3)
    assert without.run_at == START


def test_an_option_left_out_keeps_the_registrations(
    engine: sa.Engine, timed_queue: tq.TaskQueue, record: tq.RegisteredTask[Any, Any]
) -> None:
    @timed_queue.task(name="mailer", queue="mail", priority=7, max_attempts=4)
    def mailer(to: str) -> None: ...

    with Session(engine) as session:
        mailer.using(priority=1).enqueue(session, to="a@example.com")
        session.commit()
    [row] = task_rows(engine)
    assert (row.queue, row.priority, row.max_attempts) == ("mail", 1, 4)


def test_a_delay_counts_from_each_enqueue_by_the_queues_clock(
    engine: sa.Engine, record: tq.RegisteredTask[Any, Any], clock: MovableClock
) -> None:
    later = record.using(delay=timedelta(minutes=10))
    with Session(engine) as session:
        first = later.enqueue(session, key=1)
        clock.advance(timedelta(hours=1))
        second = later.enqueue(session, key=2)
        session.commit()
        ids = (first.id, second.id)
    assert [task_row(engine, task_id).run_at for task_id in ids] == [
        START + timedelta(minutes=10),
        START + timedelta(hours=1, minutes=10),
    ]


def test_enqueue_many_takes_the_options_for_every_row(
    engine: sa.Engine, record: tq.RegisteredTask[Any, Any]
) -> None:
    with Session(engine) as session:
        ids = record.using(queue="bulk", priority=3, delay=timedelta(seconds=30)).enqueue_many(
            session, [{"key": n} for n in range(3)], chunk_size=2
        )
        session.commit()
    rows = task_rows(engine)
    if ids is not None:  # MySQL cannot return the ids of a multi-row INSERT
        assert ids == [row.id for row in rows]
    assert [row.params["key"] for row in rows] == [0, 1, 2]
    assert {(row.queue, row.priority, row.run_at) for row in rows} == {
        ("bulk", 3, START + timedelta(seconds=30))
    }


def test_using_again_replaces_some_options_and_keeps_the_rest(
    engine: sa.Engine, record: tq.RegisteredTask[Any, Any]
) -> None:
    base = record.using(queue="mail", delay=timedelta(minutes=1))
    run_at = datetime(2032, 1, 1, tzinfo=UTC)
    with Session(engine) as session:
        a = base.using(priority=2).enqueue(session, key=1)
        b = base.using(run_at=run_at).enqueue(session, key=2)  # a run_at in place of the delay
        session.commit()
        ids = (a.id, b.id)
    first, second = (task_row(engine, task_id) for task_id in ids)
    assert (first.queue, first.priority, first.run_at) == ("mail", 2, START + timedelta(minutes=1))
    assert (second.queue, second.priority, second.run_at) == ("mail", 0, run_at)


REFUSED: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"queue": 5}, TypeError, "queue must be a string"),
    ({"queue": ""}, ValueError, "queue must be a non-empty string"),
    ({"queue": "q" * 101}, ValueError, "queue must be a non-empty string of at most 100"),
    ({"queue": "a\x00"}, ValueError, "queue holds"),
    ({"priority": "1"}, TypeError, "priority must be an integer"),
    ({"priority": 2**31}, ValueError, "priority must be between"),
    ({"max_attempts": 0}, ValueError, "max_attempts must be at least 1"),
    ({"max_attempts": 1.5}, TypeError, "max_attempts must be an integer"),
    ({"run_at": datetime(2030, 1, 1)}, ValueError, "run_at must be timezone-aware"),
    ({"run_at": "tomorrow"}, TypeError, "run_at must be a datetime"),
    (
        {"run_at": datetime(10000 - 1, 12, 31, 23, 59, tzinfo=timezone(timedelta(hours=-1)))},
        ValueError,
        "run_at",
    ),
    ({"delay": 10}, TypeError, "delay must be a timedelta"),
    ({"delay": timedelta(seconds=-1)}, ValueError, "delay must not be negative"),
    ({"delay": timedelta(days=4_000_000)}, ValueError, "past what a database stores"),
    ({"run_at": START, "delay": timedelta(0)}, ValueError, "run_at or delay, not both"),
]


@pytest.mark.parametrize(("options", "error", "message"), REFUSED, ids=[str(c[0])[:40] for c in REFUSED])
def test_a_bad_option_is_refused_by_using_itself(
    record: tq.RegisteredTask[Any, Any], options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        record.using(**options)


def test_params_must_still_fit_the_functions_signature(
    engine: sa.Engine, record: tq.RegisteredTask[Any, Any]
) -> None:
    with_options = record.using(queue="mail")
    with Session(engine) as session:
        with pytest.raises(TypeError, match="params do not fit task 'record'"):
            with_options.enqueue(session, wrong=1)
        with pytest.raises(TypeError, match="params do not fit task 'record'"):
            with_options.enqueue_many(session, [{"key": 1}, {"nope": 2}])
        assert not session.new
        with_options.enqueue(session, key=1)
        session.commit()
    assert [row.params for row in task_rows(engine)] == [{"key": 1}]


def test_the_options_are_checked_against_the_queues_own_table(engine: sa.Engine) -> None:
    from tests.test_session_add import AppBase, AppTask

    AppBase.metadata.drop_all(engine)
    AppBase.metadata.create_all(engine)
    try:
        queue = tq.TaskQueue(engine, model=AppTask)

        @queue.task(name="app.job")
        def job() -> None: ...

        with pytest.raises(ValueError, match="at most 20 characters"):
            job.using(queue="q" * 21)
        with pytest.raises(ValueError, match="between -32768 and 32767"):
            job.using(priority=2**15)
        with Session(engine) as session:
            task = job.using(queue="q" * 20, priority=2**15 - 1).enqueue(session)
            session.commit()
            assert (task.queue, task.priority) == ("q" * 20, 2**15 - 1)
        queue.close()
    finally:
        AppBase.metadata.drop_all(engine)


def test_repr_shows_the_options_set(record: tq.RegisteredTask[Any, Any]) -> None:
    assert (
        repr(record.using(queue="mail", priority=1)) == "<TaskWithOptions 'record' queue='mail', priority=1>"
    )
