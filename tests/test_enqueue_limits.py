"""Bad arguments never reach the database, on any enqueue path, and the caller's transaction lives on.

Every value a new task row takes is checked before any SQL is sent, against
what every supported database stores: integers within their 32-bit columns,
names and queues within their columns' lengths, no NUL and no unpaired
surrogate in any string, ``run_at`` within the years 1000 to 9999 in UTC,
params a JSON object of finite values nested at most `MAX_PARAMS_DEPTH`
deep, and fitting the registered function's signature.  The same error, of
the same type, on every backend: `TypeError` for a wrong kind, `ValueError`
for a value out of range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.limits import EARLIEST_RUN_AT, LATEST_RUN_AT, MAX_PARAMS_DEPTH
from tests.app import Execution
from tests.backends import Backend
from tests.helpers import run_cli, task_row, task_rows


def nested(depth: int) -> dict[str, Any]:
    """Params whose arrays and objects nest ``depth`` deep, the params object included."""
    value: Any = 1
    for level in range(depth - 1):
        value = [value] if level % 2 else {"x": value}
    return {"deep": value}


Enqueue = Callable[[tq.TaskQueue, Session, dict[str, Any]], object]


def by_enqueue(queue: tq.TaskQueue, session: Session, arguments: dict[str, Any]) -> object:
    return queue.enqueue(
        session, arguments.pop("name", "record"), arguments.pop("params", {"key": 1}), **arguments
    )


def by_enqueue_many(queue: tq.TaskQueue, session: Session, arguments: dict[str, Any]) -> object:
    """A good task first, then the bad one: neither may be written."""
    params = arguments.pop("params", {"key": 1})
    return queue.enqueue_many(session, arguments.pop("name", "record"), [{"key": 0}, params], **arguments)


def by_registered_task(queue: tq.TaskQueue, session: Session, arguments: dict[str, Any]) -> object:
    registered = queue.registered("record")
    assert registered is not None
    return registered.enqueue(session, **arguments["params"])


PATHS = [
    pytest.param(by_enqueue, id="enqueue"),
    pytest.param(by_enqueue_many, id="enqueue_many"),
]

BAD_ARGUMENTS = [
    pytest.param({"priority": 2**31}, ValueError, "priority must be between", id="priority-2**31"),
    pytest.param(
        {"priority": -(2**31) - 1}, ValueError, "priority must be between", id="priority-below-int32"
    ),
    pytest.param({"priority": 2**63}, ValueError, "priority must be between", id="priority-2**63"),
    pytest.param(
        {"max_attempts": 2**31}, ValueError, "max_attempts must be between", id="max_attempts-2**31"
    ),
    pytest.param(
        {"max_attempts": 2**63}, ValueError, "max_attempts must be between", id="max_attempts-2**63"
    ),
    pytest.param({"priority": 1.0}, TypeError, "priority must be an integer", id="priority-float"),
    pytest.param({"queue": "q" * 101}, ValueError, "at most 100 characters", id="queue-too-long"),
    pytest.param({"queue": "mail\x00"}, ValueError, "queue holds a NUL", id="queue-nul"),
    pytest.param(
        {"queue": "mail\ud800"}, ValueError, "queue holds an unpaired surrogate", id="queue-surrogate"
    ),
    pytest.param({"queue": b"mail"}, TypeError, "queue must be a string", id="queue-bytes"),
    pytest.param({"name": 7}, TypeError, "name must be a string", id="name-not-a-string"),
    pytest.param({"name": "record\x00"}, ValueError, "no task registered", id="name-nul"),
    pytest.param(
        {"run_at": datetime(9999, 12, 31, 23, tzinfo=timezone(-timedelta(hours=5)))},
        ValueError,
        "run_at must be between",
        id="run_at-past-9999-in-utc",
    ),
    pytest.param(
        {"run_at": datetime(1000, 1, 1, 1, tzinfo=timezone(timedelta(hours=5)))},
        ValueError,
        "run_at must be between",
        id="run_at-before-1000-in-utc",
    ),
    pytest.param({"run_at": datetime(2030, 1, 1)}, ValueError, "timezone-aware", id="run_at-naive"),
]

BAD_PARAMS = [
    pytest.param({"key": "a\x00b"}, ValueError, r"params\['key'\]: the string holds a NUL", id="nul-value"),
    pytest.param({"key\x00": 1}, ValueError, "the key holds a NUL", id="nul-key"),
    pytest.param(
        {"key": 1, "n": {"deep": ["ok", "\ud800"]}},
        ValueError,
        r"params\['n'\]\['deep'\]\[1\]",
        id="surrogate-nested",
    ),
    pytest.param({"key": float("nan")}, ValueError, "must be finite", id="nan"),
    pytest.param({"key": float("inf")}, ValueError, "must be finite", id="infinity"),
    pytest.param({"key": 2**64}, ValueError, "must fit in 64 bits", id="int-over-64-bits"),
    pytest.param({"key": object()}, TypeError, "object is not a JSON value", id="not-json"),
    pytest.param({"key": {1, 2}}, TypeError, "set is not a JSON value", id="set"),
    pytest.param(
        {"key": 1, **nested(MAX_PARAMS_DEPTH + 1)},
        ValueError,
        f"nested more than {MAX_PARAMS_DEPTH}",
        id="too-deep",
    ),
    pytest.param(
        {},
        TypeError,
        "params do not fit task 'record': missing a required argument: 'key'",
        id="missing-argument",
    ),
    pytest.param(
        {"key": 1, "colour": "red"}, TypeError, "params do not fit task 'record'", id="unexpected-argument"
    ),
]


@contextmanager
def no_sql_sent(engine: sa.Engine) -> Iterator[list[str]]:
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    sa.event.listen(engine, "before_cursor_execute", seen)
    try:
        yield statements
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
    assert statements == [], "nothing reached the database"


def refused_in_a_business_transaction(
    queue: tq.TaskQueue,
    engine: sa.Engine,
    enqueue: Enqueue,
    arguments: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    """The enqueue raises ``error`` in a transaction that wrote a business row; that row still commits."""
    with Session(engine) as session:
        session.add(Execution(task_key=42, pid=1, note="business"))
        session.flush()  # the transaction is open on the server
        with no_sql_sent(engine), pytest.raises(error, match=message):
            enqueue(queue, session, dict(arguments))
        session.add(Execution(task_key=43, pid=1, note="business"))
        session.commit()
    with engine.connect() as conn:
        assert sorted(conn.scalars(sa.select(Execution.task_key))) == [42, 43]
    assert task_rows(engine) == []


@pytest.mark.parametrize("enqueue", PATHS)
@pytest.mark.parametrize(("arguments", "error", "message"), BAD_ARGUMENTS)
def test_out_of_range_arguments_are_refused_before_any_sql_and_the_transaction_lives_on(
    default_queue: tq.TaskQueue,
    engine: sa.Engine,
    enqueue: Enqueue,
    arguments: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    refused_in_a_business_transaction(default_queue, engine, enqueue, arguments, error, message)


@pytest.mark.parametrize("enqueue", [*PATHS, pytest.param(by_registered_task, id="registered-task")])
@pytest.mark.parametrize(("params", "error", "message"), BAD_PARAMS)
def test_params_no_database_stores_or_no_call_fits_are_refused_before_any_sql(
    default_queue: tq.TaskQueue,
    engine: sa.Engine,
    enqueue: Enqueue,
    params: dict[str, Any],
    error: type[Exception],
    message: str,
) -> None:
    refused_in_a_business_transaction(default_queue, engine, enqueue, {"params": params}, error, message)


def test_values_at_the_limits_are_stored_and_read_back_on_every_backend(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    @default_queue.task(name="n" * 255, queue="q" * 100)
    def anything(**params: Any) -> None:
        pass

    deep = nested(MAX_PARAMS_DEPTH)
    text = "é ✓ \U0001f600 \ufffd"
    with Session(engine) as session:
        first = default_queue.enqueue(
            session,
            anything.name,
            {"deep": deep["deep"], "text": text, "big": 2**64 - 1, "small": -(2**63)},
            priority=2**31 - 1,
            max_attempts=2**31 - 1,
            run_at=LATEST_RUN_AT,
        ).id
        [second] = default_queue.enqueue_many(
            session, anything.name, [{}], priority=-(2**31), run_at=EARLIEST_RUN_AT
        ) or [None]
        session.commit()
    row = task_row(engine, first)
    assert (row.name, row.queue, row.priority, row.max_attempts) == (
        "n" * 255,
        "q" * 100,
        2**31 - 1,
        2**31 - 1,
    )
    assert row.params == {"deep": deep["deep"], "text": text, "big": 2**64 - 1, "small": -(2**63)}
    assert row.run_at == LATEST_RUN_AT
    if second is not None:
        assert (task_row(engine, second).priority, task_row(engine, second).run_at) == (
            -(2**31),
            EARLIEST_RUN_AT,
        )


def test_a_task_taking_any_keywords_takes_any_params(default_queue: tq.TaskQueue, session: Session) -> None:
    @default_queue.task(name="anything")
    def anything(**params: Any) -> None:
        pass

    @default_queue.task(name="one_and_more")
    def one_and_more(first: int, **more: Any) -> None:
        pass

    anything.enqueue(session, a=1, b=2)
    one_and_more.enqueue(session, first=1, b=2)
    with pytest.raises(TypeError, match="params do not fit task 'one_and_more': missing a required argument"):
        one_and_more.enqueue(session, b=2)
    session.commit()
    assert len(task_rows(session.get_bind())) == 2  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"name": "n" * 256}, "name must be a non-empty string of at most 255 characters"),
        ({"name": "task\x00"}, "name holds a NUL"),
        ({"name": "task\udcff"}, "name holds an unpaired surrogate"),
        ({"name": "t", "priority": 2**31}, "priority must be between"),
        ({"name": "t", "max_attempts": 2**31}, "max_attempts must be between"),
        ({"name": "t", "queue": "q\x00"}, "queue holds a NUL"),
    ],
)
def test_a_registration_no_row_could_hold_is_refused(
    default_queue: tq.TaskQueue, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        default_queue.task(**options)(lambda: None)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("enqueue", "n" * 256), "name must be a non-empty string of at most 255 characters"),
        (("enqueue", "bad\udcffname"), "name holds an unpaired surrogate"),
        (("enqueue", "x", "--queue", "q\udcff"), "queue holds an unpaired surrogate"),
        (("enqueue", "x", "--priority", str(2**31)), "priority must be between"),
        (("enqueue", "x", "--max-attempts", str(2**63)), "max_attempts must be between"),
        (("enqueue", "x", "--params", '{"a": "\\u0000"}'), "the string holds a NUL"),
        (("enqueue", "x", "--params", '{"a": NaN}'), "must be finite"),
        (("enqueue", "x", "--params", '{"a": ' * 5000 + "1" + "}" * 5000), "nested too deeply"),
        (
            ("enqueue", "x", "--params", '{"a": ' * 40 + "1" + "}" * 40),
            f"nested more than {MAX_PARAMS_DEPTH}",
        ),
        (("enqueue", "x", "--delay", "99999999999d"), "longer than any date"),
        (("enqueue", "x", "--delay", "3000000d"), "it must be between 0s and 36500d"),
    ],
)
def test_the_command_line_refuses_what_no_database_stores_in_one_line(
    backend: Backend, engine: sa.Engine, args: tuple[str, ...], message: str
) -> None:
    result = run_cli(*args, url=backend.url)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr, result.stderr
    assert task_rows(engine) == []


def test_run_at_is_compared_in_utc(default_queue: tq.TaskQueue, session: Session) -> None:
    late_evening = datetime(9999, 12, 31, 20, tzinfo=timezone(-timedelta(hours=3)))  # 23:00 UTC
    task = default_queue.enqueue(session, "record", {"key": 1}, run_at=late_evening)
    session.commit()
    assert task.run_at.astimezone(UTC) == datetime(9999, 12, 31, 23, tzinfo=UTC)
