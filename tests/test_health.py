"""Table health: the figures each database gives, and the findings once one passes its threshold.

The transactions that slow a queue are real ones, held open on a connection
of their own: a REPEATABLE READ snapshot on PostgreSQL, an InnoDB read view
on MariaDB.  Their age is counted with the queue's clock, which the tests
move, so "open for a minute" takes no minute.  The table is a task table of
its own, made afresh for each test, so the dead rows other tests leave in
the shared one do not count.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import DeclarativeBase

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from sa_taskqueue.health import HealthThresholds, TableHealth, health_lines
from tests.app import queue_bind
from tests.backends import Backend
from tests.helpers import MovableClock, wait_until


class HealthBase(DeclarativeBase):
    pass


class HealthTask(tq.TaskMixin, HealthBase):
    __tablename__ = "health_task"


TASKS = HealthTask.__table__
A_MINUTE_LATER = timedelta(seconds=61)
#: InnoDB refreshes what INNODB_TRX shows only once nobody has read it for 0.1 s:
#: a poll of the view waits longer than that between reads, or it sees no change.
INNODB_TRX_IDLE = 0.25


@pytest.fixture
def health_engine(engine: sa.Engine) -> Iterator[sa.Engine]:
    """``engine``, with an empty task table just made: no dead rows, no statistics from other tests."""
    HealthBase.metadata.drop_all(engine)
    HealthBase.metadata.create_all(engine)
    yield engine
    HealthBase.metadata.drop_all(engine)  # the schema tests compare the database with the model


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


@pytest.fixture
def queue(health_engine: sa.Engine, clock: MovableClock) -> Iterator[tq.TaskQueue]:
    queue = tq.TaskQueue(queue_bind(health_engine), model=HealthTask, clock=clock.now)
    yield queue
    queue.close()


def add_tasks(engine: sa.Engine, count: int) -> None:
    with engine.begin() as conn:
        conn.execute(sa.insert(TASKS), [{"name": "health.row"} for _ in range(count)])
        if engine.dialect.name == "postgresql":
            # Counters reach pg_stat_user_tables when the session next goes idle (PostgreSQL 15+).
            conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))


@contextmanager
def held_transaction(engine: sa.Engine, backend: Backend, table: sa.Table = TASKS) -> Iterator[str]:
    """A transaction left open on a connection of its own that holds back cleanup; yields who it is.

    It reads ``table``, so that it keeps a snapshot: REPEATABLE READ on
    PostgreSQL (backend_xmin), InnoDB's default REPEATABLE READ read view on
    MySQL and MariaDB.
    """
    with engine.connect() as conn:
        if backend.is_postgres:
            conn.execution_options(isolation_level="REPEATABLE READ")
            who = f"pid {conn.execute(sa.text('SELECT pg_backend_pid()')).scalar_one()}"
        else:
            who = f"thread {conn.execute(sa.text('SELECT CONNECTION_ID()')).scalar_one()}"
        conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
        yield who
        conn.rollback()


def flagged(health: TableHealth, who: str) -> list[tq.health.Finding]:
    """The findings about the transaction ``who`` ("pid 4242", "thread 17")."""
    return [
        finding
        for finding in health.findings
        if finding.figure == "transaction_age" and finding.message.startswith(f"transaction {who} (")
    ]


def test_a_quiet_table_is_healthy(backend: Backend, queue: tq.TaskQueue, clock: MovableClock) -> None:
    health = queue.table_health()
    assert health.ok, [finding.line for finding in health.findings]
    assert health.measured_at == clock.now()
    assert health.table.endswith(".health_task")
    if backend.is_postgres:
        assert (health.database, health.live_rows, health.dead_rows) == ("PostgreSQL", 0, 0)
        assert health.last_vacuum is None
        assert isinstance(health.autovacuum, bool)
    elif backend.is_mysql_family:
        # Server-wide: other databases' work may leave some undo records.
        assert isinstance(health.history_list_length, int)
        assert health.history_list_length >= 0
    else:
        assert health.database == "SQLite"
        assert health.journal_mode is not None
        assert isinstance(health.wal_bytes, int)
        assert health.page_count is not None
        assert health.page_count > 0
    document = json.loads(json.dumps(health.as_dict()))
    assert document["ok"] is True
    assert document["findings"] == []
    assert document["thresholds"]["transaction_age"] == 60.0
    assert health_lines(health)[0] == f"table health of {health.table} ({health.database}): ok"


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_a_transaction_left_open_is_flagged_once_it_is_a_minute_old(
    backend: Backend, health_engine: sa.Engine, queue: tq.TaskQueue, clock: MovableClock
) -> None:
    def listed(health: TableHealth) -> list[tq.health.OpenTransaction]:
        return [tx for tx in health.open_transactions if tx.who == who]

    with held_transaction(health_engine, backend) as who:
        wait_until(lambda: listed(queue.table_health()), 10, f"{who} to be listed", every=INNODB_TRX_IDLE)
        young = queue.table_health()
        [transaction] = listed(young)
        assert transaction.state == "idle in transaction"
        assert transaction.age is not None
        assert transaction.age < timedelta(seconds=60)
        assert flagged(young, who) == []

        clock.advance(A_MINUTE_LATER)
        old = queue.table_health()
        [finding] = flagged(old, who)
        assert not old.ok
        assert finding.value > 60
        assert finding.threshold == 60
        assert f"transaction {who} (idle in transaction" in finding.line
        assert "has been open 6" in finding.message  # 61 s, or 62 s on MariaDB's whole seconds
        if backend.is_postgres:
            assert "holds back vacuum of public.health_task" in finding.message
            assert "idle_in_transaction_session_timeout" in finding.advice
        else:
            assert "holds back InnoDB's purge" in finding.message
            assert f"KILL {who.removeprefix('thread ')}" in finding.advice
        assert any(line == f"finding: {finding.line}" for line in health_lines(old))
        # The time and the threshold can both be given per call.
        assert flagged(queue.table_health(now=clock.now() - A_MINUTE_LATER), who) == []
        patient = HealthThresholds(transaction_age=timedelta(minutes=2))
        assert flagged(queue.table_health(thresholds=patient), who) == []

    wait_until(
        lambda: not listed(queue.table_health()),
        10,
        f"{who} to be gone once it rolled back",
        every=INNODB_TRX_IDLE,
    )


@pytest.mark.backends("postgres")
def test_dead_rows_an_open_transaction_keeps_from_vacuum(
    backend: Backend, health_engine: sa.Engine, queue: tq.TaskQueue, clock: MovableClock
) -> None:
    add_tasks(health_engine, 300)
    with held_transaction(health_engine, backend) as who:
        with health_engine.begin() as conn:
            conn.execute(sa.delete(TASKS))
            conn.execute(sa.text("SELECT pg_stat_force_next_flush()"))

        def counted() -> bool:
            health = queue.table_health()
            return health.live_rows == 0 and (health.dead_rows or 0) >= 300

        wait_until(counted, 30, "the statistics to count 300 dead rows and no live one")
        thresholds = HealthThresholds(dead_rows=100)
        young = queue.table_health(thresholds=thresholds)
        [dead] = [finding for finding in young.findings if finding.figure == "dead_rows"]
        assert dead.value == young.dead_rows
        assert dead.threshold == 100
        assert "public.health_task holds" in dead.message
        assert "VACUUM public.health_task" in dead.advice

        # Once the transaction is over the threshold, the advice names it as the cause.
        clock.advance(A_MINUTE_LATER)
        old = queue.table_health(thresholds=thresholds)
        [dead] = [finding for finding in old.findings if finding.figure == "dead_rows"]
        assert f"vacuum cannot remove them while transaction {who} is open" in dead.advice
        # Many dead rows beside many more live ones are ordinary churn.
        assert queue.table_health(thresholds=HealthThresholds(dead_rows=100, dead_row_ratio=0)).findings
        assert not [
            finding
            for finding in queue.table_health(thresholds=HealthThresholds(dead_rows=1000)).findings
            if finding.figure == "dead_rows"
        ]


@pytest.mark.backends("mysql", "mariadb")
def test_the_history_list_grows_while_a_read_view_is_open(
    backend: Backend, health_engine: sa.Engine, queue: tq.TaskQueue
) -> None:
    add_tasks(health_engine, 2)
    with held_transaction(health_engine, backend):
        # Each committed UPDATE leaves an undo log the open read view may need: purge keeps it.
        for priority in range(3):
            with health_engine.begin() as conn:
                conn.execute(sa.update(TASKS).values(priority=priority + 1))
        health = queue.table_health(thresholds=HealthThresholds(history_list_length=2))
    assert health.history_list_length is not None
    assert health.history_list_length >= 3
    [finding] = [finding for finding in health.findings if finding.figure == "history_list_length"]
    assert finding.value == health.history_list_length
    assert finding.threshold == 2
    assert "undo records not purged yet" in finding.message


@pytest.mark.backends("sqlite")
def test_the_size_of_the_write_ahead_log(health_engine: sa.Engine, queue: tq.TaskQueue) -> None:
    queue.strategy  # noqa: B018 - the first use switches the file to WAL
    add_tasks(health_engine, 50)
    health = queue.table_health()
    assert health.journal_mode == "wal"
    assert health.wal_bytes is not None
    assert health.wal_bytes > 0
    assert health.ok
    # Over the threshold, not at it.
    assert queue.table_health(thresholds=HealthThresholds(wal_bytes=health.wal_bytes)).ok
    small = queue.table_health(thresholds=HealthThresholds(wal_bytes=health.wal_bytes - 1))
    [finding] = small.findings
    assert (finding.figure, finding.value) == ("wal_bytes", health.wal_bytes)
    assert "wal_checkpoint(TRUNCATE)" in finding.advice


def test_a_table_never_migrated_says_so(health_engine: sa.Engine, queue: tq.TaskQueue) -> None:
    HealthBase.metadata.drop_all(health_engine)
    with pytest.raises(tq.SchemaMissing, match="the task table 'health_task' does not exist"):
        queue.table_health()


def test_oracle_says_it_is_not_measured() -> None:
    # Nothing connects: no figure is read on Oracle.
    queue = tq.TaskQueue(sa.create_engine("oracle+oracledb://scott:tiger@127.0.0.1:1/nowhere"))
    now = datetime.fromisoformat("2026-11-25T12:00:00+00:00")
    health = queue.table_health(now=now)
    assert health.ok
    assert health.database == "Oracle"
    assert health.measured_at == now
    assert health.notes[0].startswith("not measured on Oracle")
    assert health.as_dict()["figures"]["open_transactions"] == []


@pytest.mark.parametrize(
    ("given", "error", "says"),
    [
        ({"dead_rows": -1}, ValueError, "dead_rows must be 0 or more"),
        ({"wal_bytes": 1.5}, TypeError, "wal_bytes must be a whole number"),
        ({"history_list_length": True}, TypeError, "history_list_length must be a whole number"),
        ({"dead_row_ratio": float("nan")}, ValueError, "dead_row_ratio must be a finite number"),
        ({"transaction_age": 60}, TypeError, "transaction_age must be a timedelta"),
        ({"transaction_age": timedelta(seconds=-1)}, ValueError, "transaction_age must not be negative"),
    ],
)
def test_bad_thresholds_are_refused_by_name(
    given: dict[str, object], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=says):
        HealthThresholds(**given)  # type: ignore[arg-type]


def test_the_time_must_be_aware() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))
    with pytest.raises(TypeError, match="now must be an aware datetime"):
        queue.table_health(now=datetime(2026, 11, 25, 12, 0))
    with pytest.raises(TypeError, match="thresholds must be a HealthThresholds"):
        queue.table_health(thresholds={"wal_bytes": 1})  # type: ignore[arg-type]


@pytest.fixture
def run(backend: Backend) -> Callable[..., Result]:
    """``sa-taskqueue ARGS`` in this process, on the library's own table at the backend's URL."""
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(
            cli, list(args), env={"SA_TASKQUEUE_DATABASE_URL": backend.url}, catch_exceptions=False
        )

    return invoke


def test_the_health_command_prints_findings_as_text_and_json(
    backend: Backend, engine: sa.Engine, run: Callable[..., Result]
) -> None:
    # Something over a threshold on every database: a transaction open longer
    # than 0 s, or a WAL file larger than 0 bytes (written to just now).
    holding: AbstractContextManager[str]
    if backend.is_sqlite:
        tq.TaskQueue(engine).strategy  # noqa: B018 - the first use switches the file to WAL
        threshold, holding = ["--max-wal-bytes", "0"], nullcontext("")
    else:
        threshold, holding = (
            ["--max-transaction-age", "0s"],
            held_transaction(engine, backend, tq.Task.__table__),
        )
    with engine.begin() as conn:
        conn.execute(sa.insert(tq.Task.__table__), [{"name": "health.row"}])
    with holding as who:
        wanted = f"transaction {who} (idle in transaction" if who else "the write-ahead log"
        if who:
            seen = tq.TaskQueue(engine)
            wait_until(
                lambda: any(tx.who == who for tx in seen.table_health().open_transactions),
                10,
                f"{who} to be listed",
                every=INNODB_TRX_IDLE,
            )
        text = run("health", *threshold)
        as_json = run("health", "--json", *threshold)
    assert text.exit_code == 0, text.output
    lines = text.output.splitlines()
    assert lines[0].startswith("table health of ")
    assert "finding" in lines[0]
    assert any(line.startswith(f"finding: {wanted}") for line in lines), lines
    assert as_json.exit_code == 0, as_json.output
    document = json.loads(as_json.output)
    assert document["ok"] is False
    assert any(finding["message"].startswith(wanted) for finding in document["findings"])
    assert set(document["figures"]) >= {"dead_rows", "open_transactions", "history_list_length", "wal_bytes"}


def test_the_health_command_refuses_a_bad_threshold(run: Callable[..., Result]) -> None:
    result = run("health", "--max-dead-row-ratio", "inf")
    assert result.exit_code == 2
    assert "dead_row_ratio must be a finite number" in result.output


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_doctor_flags_a_transaction_held_open_past_its_threshold(
    backend: Backend, health_engine: sa.Engine, engine: sa.Engine, run: Callable[..., Result]
) -> None:
    with held_transaction(health_engine, backend) as who:
        finding = f"finding: transaction {who} ("
        strict: list[Result] = []

        def flagged_by_doctor() -> bool:
            strict[:] = [run("doctor", "--max-transaction-age", "1s", "--strict")]
            return finding in strict[0].output

        wait_until(flagged_by_doctor, 30, f"doctor to flag {who}", every=INNODB_TRX_IDLE)
        assert strict[0].exit_code == 1, "a finding fails doctor --strict"
        assert "  passed  " in strict[0].output, "while the locking checks pass"
        told = run("doctor", "--max-transaction-age", "1s")
        assert finding in told.output
        assert told.exit_code == 0, "without --strict a finding is reported, not a failure"
