"""Typed params: datetimes, dates, times, timedeltas, Decimals, UUIDs, Enums and registered classes.

Each is stored as plain JSON (read back here with SQL, as any other reader
would) and reaches the task function, run by a real worker, as the type its
annotation asks for, whichever way it was enqueued.
"""

from __future__ import annotations

import asyncio
import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Annotated, Any
from uuid import UUID

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sa_taskqueue as tq
from sa_taskqueue.core import param_types, validation
from sa_taskqueue.core.bulk_insert import COPY_THRESHOLD
from tests.backends import ASYNC_DRIVERS, Backend, async_url
from tests.helpers import MovableClock, task_row
from tests.helpers import task_rows as rows


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@dataclass(frozen=True)
class Money:
    """An application's own class, stored as ``{"amount": "12.50", "currency": "EUR"}``."""

    amount: Decimal
    currency: str


def _decode_money(value: Any) -> Money:
    return Money(Decimal(value["amount"]), value["currency"])


tq.register_type(Money, encode=lambda m: {"amount": m.amount, "currency": m.currency}, decode=_decode_money)

WHEN = datetime(2026, 5, 1, 9, 30, 15, 250000, tzinfo=timezone(timedelta(hours=2)))
DAY = date(2026, 2, 28)
AT = time(23, 59, 1)
SPAN = timedelta(days=1, hours=2, minutes=30, seconds=0.5)
PRICE = Decimal("12.50")
ID = UUID("12345678-1234-5678-1234-567812345678")
EUROS = Money(Decimal("9.99"), "EUR")

#: The params every round trip passes, and the JSON each is stored as.
TYPED: dict[str, Any] = {
    "when": WHEN,
    "day": DAY,
    "at": AT,
    "span": SPAN,
    "price": PRICE,
    "ident": ID,
    "color": Color.BLUE,
    "level": Level.HIGH,
    "money": EUROS,
    "whens": [WHEN, WHEN.astimezone(UTC)],
    "prices": {"a": Decimal("1"), "b": Decimal("2.000")},
    "maybe": None,
    "maybe_day": DAY,
    "tagged": ID,
    "plain": "as is",
}
STORED: dict[str, Any] = {
    "when": "2026-05-01T09:30:15.250000+02:00",
    "day": "2026-02-28",
    "at": "23:59:01",
    "span": "P1DT2H30M0.5S",
    "price": "12.50",
    "ident": "12345678-1234-5678-1234-567812345678",
    "color": "blue",
    "level": 2,
    "money": {"amount": "9.99", "currency": "EUR"},
    "whens": ["2026-05-01T09:30:15.250000+02:00", "2026-05-01T07:30:15.250000+00:00"],
    "prices": {"a": "1", "b": "2.000"},
    "maybe": None,
    "maybe_day": "2026-02-28",
    "tagged": "12345678-1234-5678-1234-567812345678",
    "plain": "as is",
}


def register_typed(queue: tq.TaskQueue, received: list[dict[str, Any]], name: str = "typed") -> Any:
    @queue.task(name=name)
    def typed(
        when: datetime,
        day: date,
        at: time,
        span: timedelta,
        price: Decimal,
        ident: UUID,
        color: Color,
        level: Level,
        money: Money,
        whens: list[datetime],
        prices: dict[str, Decimal],
        maybe: datetime | None,
        maybe_day: date | None,
        tagged: Annotated[UUID, "an id"],
        plain: Any,
    ) -> None:
        received.append({name: value for name, value in locals().items() if name != "received"})

    return typed


def assert_received_as_typed(got: dict[str, Any]) -> None:
    assert got == TYPED
    # Equal is not enough: an IntEnum equals its int, a datetime's offset must be kept.
    assert {name: type(value) for name, value in got.items()} == {
        name: type(value) for name, value in TYPED.items()
    }
    assert got["when"].utcoffset() == timedelta(hours=2)
    assert type(got["whens"][1]) is datetime and type(got["prices"]["b"]) is Decimal
    assert str(got["prices"]["b"]) == "2.000"


def stored_params(engine: sa.Engine) -> list[Any]:
    """The params column as the database returns it to plain SQL."""
    with engine.connect() as conn:
        values = conn.execute(sa.text("SELECT params FROM sa_taskqueue_task ORDER BY id")).scalars().all()
    return [json.loads(value) if isinstance(value, str | bytes) else value for value in values]


def run_worker(queue: tq.TaskQueue, **options: Any) -> tq.Worker:
    return queue.run_worker(concurrency=2, burst=True, poll_interval=0.05, **options)


def enqueue_with_queue(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    queue.enqueue(session, "typed", TYPED)


def enqueue_with_task(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    task.enqueue(session, **TYPED)


def enqueue_with_options(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    task.using(priority=3).enqueue(session, **TYPED)


def enqueue_many_small(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    queue.enqueue_many(session, "typed", [TYPED, TYPED])


def enqueue_many_bulk(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    # Past the COPY threshold: PostgreSQL's COPY path, multi-row INSERTs elsewhere.
    task.using(queue="default").enqueue_many(session, [TYPED] * (COPY_THRESHOLD + 5))


def add_task_row(queue: tq.TaskQueue, session: Session, task: Any) -> None:
    session.add(tq.Task(name="typed", params=dict(TYPED)))
    session.flush()


ENQUEUE_PATHS: dict[str, Callable[[tq.TaskQueue, Session, Any], None]] = {
    "queue.enqueue": enqueue_with_queue,
    "task.enqueue": enqueue_with_task,
    "task.using.enqueue": enqueue_with_options,
    "enqueue_many": enqueue_many_small,
    "enqueue_many-bulk": enqueue_many_bulk,
    "session.add": add_task_row,
}


@pytest.mark.parametrize("path", ENQUEUE_PATHS)
def test_each_type_is_stored_as_plain_json_and_reaches_the_function_as_its_annotated_type(
    path: str, engine: sa.Engine
) -> None:
    queue = tq.TaskQueue(engine)
    received: list[dict[str, Any]] = []
    task = register_typed(queue, received)
    with Session(engine) as session:
        ENQUEUE_PATHS[path](queue, session, task)
        session.commit()
    stored = stored_params(engine)
    assert stored and all(params == STORED for params in stored)
    worker = run_worker(queue)
    assert (worker.processed, worker.failed) == (len(stored), 0)
    assert len(received) == len(stored)
    for got in received:
        assert_received_as_typed(got)


def test_the_caller_s_params_are_left_as_they_were(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)
    register_typed(queue, [])
    given = dict(TYPED)
    with Session(engine) as session:
        task = queue.enqueue(session, "typed", given)
        session.commit()
        assert task.params == STORED
    assert given == TYPED and given["whens"] is TYPED["whens"]


def test_a_task_run_in_a_child_process_gets_its_types(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)

    @queue.task(name="describe")
    def describe(when: datetime, prices: list[Decimal], color: Color | None = None) -> list[str]:
        return [repr(when), repr(prices), repr(color)]

    with Session(engine) as session:
        queue.enqueue(session, "describe", {"when": WHEN, "prices": [PRICE], "color": Color.RED})
        session.commit()
    worker = run_worker(queue, isolation="process")
    assert (worker.processed, worker.failed) == (1, 0)
    [row] = rows(engine)
    assert row.result == [repr(WHEN), repr([PRICE]), repr(Color.RED)]


def test_a_transactional_task_gets_its_types_after_its_session(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)

    @queue.task(name="booked", transactional=True)
    def booked(session: Session, day: date, amounts: list[Decimal]) -> list[str]:
        assert isinstance(session, Session)
        return [repr(day), repr(amounts)]

    with Session(engine) as session:
        queue.enqueue(session, "booked", {"day": DAY, "amounts": [PRICE]})
        session.commit()
    worker = run_worker(queue)
    assert (worker.processed, worker.failed) == (1, 0)
    [row] = rows(engine)
    assert row.result == [repr(DAY), repr([PRICE])]


def test_periodic_params_are_stored_as_json_and_reach_the_function_typed(engine: sa.Engine) -> None:
    clock = MovableClock(datetime(2026, 1, 1, tzinfo=UTC))
    queue = tq.TaskQueue(engine, clock=clock.now)
    received: list[tuple[Any, ...]] = []

    @queue.periodic(every=timedelta(minutes=5), params={"since": SPAN, "price": PRICE}, name="tick")
    def tick(since: timedelta, price: Decimal) -> None:
        received.append((since, price))

    queue.enqueue_due_schedules()
    clock.advance(timedelta(minutes=5))
    assert len(queue.enqueue_due_schedules()) == 1
    assert stored_params(engine) == [{"since": "P1DT2H30M0.5S", "price": "12.50"}]
    run_worker(queue)
    assert received == [(SPAN, PRICE)]
    assert type(received[0][1]) is Decimal


@pytest.mark.async_path
def test_an_async_queue_enqueues_typed_params_one_by_one_and_in_bulk(
    backend: Backend, engine: sa.Engine
) -> None:
    driver = ASYNC_DRIVERS[backend.name][0]
    async_engine = create_async_engine(async_url(backend.url, driver), poolclass=NullPool)
    queue = tq.TaskQueue(async_engine)
    received: list[dict[str, Any]] = []
    task = register_typed(queue, received)

    @queue.task(name="atyped")
    async def atyped(when: datetime, ids: list[UUID]) -> None:
        received.append({"when": when, "ids": ids})

    async def main() -> None:
        async with AsyncSession(async_engine) as session:
            await queue.enqueue(session, "typed", TYPED)
            await task.enqueue(session, **TYPED)
            await queue.enqueue_many(session, "typed", [TYPED] * (COPY_THRESHOLD + 1))
            await queue.enqueue(session, "atyped", {"when": WHEN, "ids": [ID]})
            await session.commit()
        await async_engine.dispose()

    asyncio.run(main())
    try:
        worker = run_worker(queue)
    finally:
        queue.close()
    assert stored_params(engine)[:-1] == [STORED] * (COPY_THRESHOLD + 3)
    assert (worker.processed, worker.failed) == (COPY_THRESHOLD + 4, 0)
    assert {"when": WHEN, "ids": [ID]} in received
    for got in received:
        if "ids" in got:
            assert type(got["ids"][0]) is UUID and got["when"].utcoffset() == timedelta(hours=2)
        else:
            assert_received_as_typed(got)


def test_untyped_params_get_the_stored_json_as_before(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)
    received: list[tuple[Any, ...]] = []

    @queue.task(name="untyped")
    def untyped(when, price, count: int, names: list[str], anything: Any) -> None:  # type: ignore[no-untyped-def]
        received.append((when, price, count, names, anything))

    with Session(engine) as session:
        queue.enqueue(
            session,
            "untyped",
            {"when": WHEN, "price": PRICE, "count": 3, "names": ["a"], "anything": Color.RED},
        )
        session.commit()
    run_worker(queue)
    assert received == [(STORED["when"], "12.50", 3, ["a"], "red")]
    params = {"count": 1, "when": "x"}
    assert untyped.call_params(params) is params  # (nothing to convert: the same dict, no copy)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        (
            {"when": datetime(2026, 1, 1)},
            ValueError,
            "params['when']: datetime: datetimes must be timezone-aware",
        ),
        (
            {"x": [object()]},
            TypeError,
            "params['x'][0]: object is not a JSON value, nor a type params can hold",
        ),
        ({"x": {"y": {1, 2}}}, TypeError, "params['x']['y']: set is not a JSON value"),
    ],
)
def test_values_neither_json_nor_a_known_type_are_refused_naming_the_param(
    engine: sa.Engine, params: dict[str, Any], error: type[Exception], message: str
) -> None:
    queue = tq.TaskQueue(engine)
    queue.task(name="any")(lambda **params: None)
    with Session(engine) as session:
        with pytest.raises(error, match=r"^" + re.escape(message)):
            queue.enqueue(session, "any", params)
        with pytest.raises(error, match=re.escape(message)):
            queue.enqueue_many(session, "any", [{}, params])
        session.add(tq.Task(name="any", params=params))
        with pytest.raises(error, match=re.escape(message)):
            session.flush()
        session.rollback()
    assert rows(engine) == []


@pytest.mark.parametrize(
    ("params", "param", "problem"),
    [
        ({"when": "yesterday"}, "when", "cannot be read as a datetime from 'yesterday'"),
        ({"when": WHEN.isoformat(), "ids": ["nope"]}, "ids[0]", "cannot be read as a UUID from 'nope'"),
        ({"when": WHEN.isoformat(), "color": "green"}, "color", "cannot be read as Color from 'green'"),
        (
            {"when": WHEN.isoformat(), "money": {"amount": "x", "currency": "EUR"}},
            "money",
            "cannot be read as Money from",
        ),
    ],
)
def test_a_stored_value_that_cannot_become_its_type_fails_the_task_for_good_naming_task_and_param(
    engine: sa.Engine, params: dict[str, Any], param: str, problem: str
) -> None:
    queue = tq.TaskQueue(engine)
    ran: list[object] = []

    @queue.task(name="strict", max_attempts=3)
    def strict(
        when: datetime, ids: list[UUID] | None = None, color: Color | None = None, money: Money | None = None
    ) -> None:
        ran.append(when)

    with Session(engine) as session:
        # Written as plain JSON strings (as SQL or another language would): they pass the enqueue check.
        task = queue.enqueue(session, "strict", params)
        session.commit()
        task_id = task.id
    worker = run_worker(queue)
    assert (worker.processed, worker.failed) == (0, 1)
    row = task_row(engine, task_id)
    assert (row.status, row.attempts) == (tq.TaskStatus.FAILED, 1)  # not retried: it could never run
    assert row.last_error is not None
    assert f"ParamTypeError: task 'strict': param '{param}' {problem}" in row.last_error
    assert ran == []


def test_a_converter_error_is_a_param_type_error_naming_the_task(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)

    @queue.task(name="dated")
    def dated(days: dict[str, list[date]]) -> None:
        pass

    with pytest.raises(tq.ParamTypeError) as raised:
        dated.call_params({"days": {"a": ["2026-01-01", "2026-13-01"]}})
    assert (raised.value.task_name, raised.value.param) == ("dated", "days['a'][1]")
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, tq.MalformedTask)
    assert dated.call_params({"days": {"a": ["2026-01-01"]}}) == {"days": {"a": [date(2026, 1, 1)]}}


def test_unique_keys_from_typed_params_are_stable(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)

    @queue.task(name="report", unique_by=("day", "account"))
    def report(day: date, account: UUID, at: datetime) -> None:
        pass

    with Session(engine) as session:
        first = report.enqueue(session, day=DAY, account=ID, at=WHEN)
        again = report.enqueue(session, day=date(2026, 2, 28), account=UUID(str(ID)), at=WHEN + SPAN)
        other = report.enqueue(session, day=DAY + timedelta(days=1), account=ID, at=WHEN)
        as_json = queue.enqueue(session, "report", {"day": "2026-02-28", "account": str(ID), "at": "x"})
        session.commit()
        assert first.id == again.id == as_json.id != other.id
        assert first.unique_key == json.dumps(
            {"account": str(ID), "day": "2026-02-28"}, separators=(",", ":")
        )


def test_concurrency_keys_from_typed_params_are_stable(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)

    @queue.task(name="per_day", concurrency_limit=1, concurrency_key="day")
    def per_day(day: date) -> None:
        pass

    @queue.task(name="by_default", concurrency_limit=1, concurrency_key="day")
    def by_default(day: date = DAY) -> None:
        pass

    with Session(engine) as session:
        tasks = [per_day.enqueue(session, day=DAY), queue.enqueue(session, "per_day", {"day": "2026-02-28"})]
        defaulted = [by_default.enqueue(session), by_default.enqueue(session, day=DAY)]
        session.commit()
        assert {task.concurrency_key for task in tasks} == {'per_day:"2026-02-28"'}
        assert {task.concurrency_key for task in defaulted} == {'by_default:"2026-02-28"'}


def test_encodings_are_canonical_and_read_back() -> None:
    cases: list[tuple[Any, Any]] = [
        (timedelta(0), "PT0S"),
        (timedelta(hours=1, minutes=30), "PT1H30M"),
        (timedelta(days=2), "P2D"),
        (timedelta(microseconds=5), "PT0.000005S"),
        (-timedelta(hours=1), "-PT1H"),
        (time(8, 0, tzinfo=UTC), "08:00:00+00:00"),
        (Decimal("-1E+3"), "-1E+3"),
        (UUID("ABCDEF00-0000-0000-0000-000000000000"), "abcdef00-0000-0000-0000-000000000000"),
    ]
    for value, stored in cases:
        known, encoded = param_types.encode(value)
        assert (known, encoded) == (True, stored)
        converter = param_types.converter_for(type(value))
        assert converter is not None and converter(stored) == value
    as_timedelta = param_types.converter_for(timedelta)
    assert as_timedelta is not None
    assert as_timedelta(90) == timedelta(seconds=90) and as_timedelta("P1W") == timedelta(days=7)
    as_datetime = param_types.converter_for(datetime)
    assert as_datetime is not None and as_datetime("2026-01-01T00:00:00") == datetime(2026, 1, 1, tzinfo=UTC)
    for bad in ("P", "PT", "P1DT", "1H"):
        with pytest.raises(param_types.ParamMismatch):
            as_timedelta(bad)
    assert param_types.converter_for(int) is None and param_types.converter_for(list[str]) is None
    assert param_types.converter_for(dict[str, int] | None) is None


def test_registering_a_built_in_or_json_type_is_refused() -> None:
    for cls in (datetime, Color, str, dict):
        with pytest.raises(ValueError, match="cannot be registered"):
            tq.register_type(cls, encode=str, decode=str)
    with pytest.raises(TypeError, match="takes a class"):
        tq.register_type("Money", encode=str, decode=str)  # type: ignore[arg-type]


class Late:
    """Registered by the test below, after a task annotated with it."""

    def __init__(self, text: str) -> None:
        self.text = text


class Unencodable:
    """Registered with an encoder that raises."""


def _refuse(value: Unencodable) -> Any:
    raise RuntimeError("no encoding today")


tq.register_type(Unencodable, encode=_refuse, decode=lambda value: Unencodable())


def test_an_encoder_s_error_is_a_type_error_naming_the_param() -> None:
    with pytest.raises(
        TypeError, match=re.escape("params['x'][0]: Unencodable: its encoder raised RuntimeError")
    ):
        validation.storable_params({"x": [Unencodable()]})


def test_a_type_registered_after_the_task_is_converted_all_the_same() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))

    @queue.task(name="late")
    def late(value: Late) -> None:
        pass

    assert late.call_params({"value": "x"}) == {"value": "x"}
    tq.register_type(Late, encode=lambda late: late.text, decode=Late)
    converted = late.call_params({"value": "x"})
    assert isinstance(converted["value"], Late) and converted["value"].text == "x"
