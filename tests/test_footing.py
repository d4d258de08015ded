"""The self-test a worker runs at start, and `sa-taskqueue doctor`: passing on plain servers, naming faults.

Against every live database the checks of each strategy pass.  Against a
real PgBouncer in transaction pooling mode (tests.pgbouncer) the advisory-lock
and LISTEN checks fail naming the pooler, SKIP LOCKED still passes, and the
worker refuses to start.  A server that accepts SKIP LOCKED and ignores it is
played by compiling the claim's locking clause without it: the probe then
blocks on the locked row, and the lock timeout ends the wait.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.core.exceptions import FootingError
from sa_taskqueue.core.notify import can_listen
from sa_taskqueue.health.self_test import PROBE_KIND, TRANSACTION_POOLING, FootingReport
from sa_taskqueue.worker.worker import Worker
from tests.app import ASYNC_DRIVER_VARIABLE, make_engine
from tests.backends import Backend
from tests.helpers import run_cli
from tests.pgbouncer import pgbouncer

#: The check each strategy's self-test runs.
LOCK_CHECK = {
    "skip_locked": "skip_locked",
    "advisory_lock": "advisory_lock",
    "conditional_update": "conditional_update",
}


def names(report: FootingReport) -> list[str]:
    return [check.name for check in report.checks]


def probe_rows(engine: sa.Engine) -> int:
    control = tq.Task.__table__.metadata.tables["sa_taskqueue_task_control"]
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).select_from(control).where(control.c.kind == PROBE_KIND)
        ).scalar_one()


def test_the_self_test_passes_on_a_plain_server(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    report = queue.check_footing()
    assert report.ok, report.lines()
    expected = [LOCK_CHECK[queue.strategy.name]]
    if can_listen(queue.engine):
        expected.append("listen")
    assert names(report) == expected
    assert probe_rows(engine) == 0, "the probe row is removed"
    assert names(queue.check_footing(listen=False)) == expected[:1]


def test_a_worker_proves_its_footing_then_runs(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    from tests.helpers import enqueue_records

    enqueue_records(queue, engine, 2)
    worker = Worker(queue, burst=True, watchdog=False)
    worker.run()
    assert worker.processed == 2


# A server that ignores SKIP LOCKED --------------------------------------------------------


@pytest.fixture
def skip_locked_ignored(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    """A skip_locked queue on an engine whose compiler leaves SKIP LOCKED out of FOR UPDATE.

    The statement the server gets is what a server that ignores the clause
    runs.  A new engine: the suite's has the probe's statement compiled already.
    """
    fresh = make_engine(engine.url.render_as_string(hide_password=False))
    compiler = fresh.dialect.statement_compiler
    honest = compiler.for_update_clause

    def without_skip_locked(self: object, select: object, **kw: object) -> str:
        return str(honest(self, select, **kw)).replace(" SKIP LOCKED", "")  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiler, "for_update_clause", without_skip_locked)
        # On the sync engine whatever --async-driver says: an async twin of
        # the suite's engine would bring its own compiled statements.
        queue = tq.TaskQueue(fresh, strategy="skip_locked")
        yield queue
        queue.close()
    fresh.dispose()


def bounded(run: object, seconds: float) -> object:
    """``run()`` in a thread, which must be done within ``seconds``: a hang fails instead of stalling."""
    outcome: list[object] = []

    def target() -> None:
        try:
            outcome.append(run())  # type: ignore[operator]
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds}s: the lock wait was not bounded"
    return outcome[0]


@pytest.mark.requires("skip_locked")
def test_a_server_that_ignores_skip_locked_is_refused_not_waited_on(
    skip_locked_ignored: tq.TaskQueue, engine: sa.Engine
) -> None:
    report = bounded(lambda: skip_locked_ignored.check_footing(listen=False), 30)
    assert isinstance(report, FootingReport)
    [check] = report.checks
    assert not check.passed
    assert "does not honour SKIP LOCKED" in check.detail
    assert "blocked on it" in check.detail
    assert "conditional_update" in check.detail, "the fix is named"
    assert probe_rows(engine) == 0

    refused = bounded(Worker(skip_locked_ignored, burst=True, watchdog=False).run, 30)
    assert isinstance(refused, FootingError), refused
    assert "does not honour SKIP LOCKED" in str(refused)

    in_a_loop = skip_locked_ignored.run_worker_async(burst=True, watchdog=False)
    refused = bounded(lambda: asyncio.run(in_a_loop), 30)
    assert isinstance(refused, FootingError), refused


@pytest.mark.requires("skip_locked")
def test_a_worker_told_not_to_test_starts_all_the_same(skip_locked_ignored: tq.TaskQueue) -> None:
    worker = Worker(skip_locked_ignored, burst=True, watchdog=False, self_test=False)
    worker.run()
    assert worker.processed == 0


# PgBouncer in transaction pooling mode ----------------------------------------------------


@pytest.fixture(scope="module")
def transaction_pooler(backend: Backend) -> Iterator[str]:
    with pgbouncer(backend.url, "transaction") as url:
        yield url


@pytest.mark.slow  # starts PgBouncer
@pytest.mark.backends("postgres")
def test_behind_pgbouncer_in_transaction_mode_advisory_locks_and_listen_fail_naming_it(
    transaction_pooler: str, engine: sa.Engine
) -> None:
    pooled = sa.create_engine(transaction_pooler)
    try:
        advisory = tq.TaskQueue(pooled, strategy="advisory_lock")
        report = advisory.check_footing()
        assert names(report) == ["advisory_lock", "listen"]
        for check in report.checks:
            assert not check.passed
            assert TRANSACTION_POOLING in check.detail, check.detail
        assert "skip_locked strategy" in report.checks[0].detail
        assert "listen=False (--no-listen)" in report.checks[1].detail

        skip_locked = tq.TaskQueue(pooled, strategy="skip_locked")
        report = skip_locked.check_footing(listen=False)
        assert report.ok, report.lines()

        with pytest.raises(FootingError, match="transaction pooling"):
            Worker(advisory, burst=True, watchdog=False).run()
        assert probe_rows(engine) == 0
    finally:
        pooled.dispose()


@pytest.mark.slow  # starts PgBouncer and the command line
@pytest.mark.backends("postgres")
def test_behind_pgbouncer_the_worker_refuses_and_doctor_says_why(transaction_pooler: str) -> None:
    # Through psycopg whatever --async-driver says: asyncpg's prepared statements
    # need a setting of their own behind a transaction pooler, and are not what is shown here.
    advisory = {"SA_TASKQUEUE_TEST_STRATEGY": "advisory_lock", ASYNC_DRIVER_VARIABLE: ""}
    worker = run_cli("worker", "tests.cli_app:queue", "--burst", url=transaction_pooler, **advisory)
    assert worker.returncode != 0
    assert "refuses to start" in worker.stderr
    assert (
        f"error: the self-test failed, so this worker will not start: advisory_lock: {TRANSACTION_POOLING}"
        in (worker.stderr)
    )

    doctor = run_cli("doctor", "--app", "tests.cli_app:queue", url=transaction_pooler, **advisory)
    assert doctor.returncode == 1, doctor.stderr
    lines = doctor.stdout.splitlines()
    assert lines, doctor.stderr
    assert lines[0].startswith("self-test (advisory_lock strategy, postgresql+")
    assert lines[1].startswith(f"  FAILED  advisory_lock: {TRANSACTION_POOLING}")
    assert lines[2].startswith(f"  FAILED  listen: {TRANSACTION_POOLING}")


@pytest.mark.slow  # starts PgBouncer
@pytest.mark.backends("postgres")
def test_behind_pgbouncer_in_session_mode_everything_holds(backend: Backend, engine: sa.Engine) -> None:
    with pgbouncer(backend.url, "session") as url:
        pooled = sa.create_engine(url)
        try:
            report = tq.TaskQueue(pooled, strategy="advisory_lock").check_footing()
            assert report.ok, report.lines()
            assert names(report) == ["advisory_lock", "listen"]
        finally:
            pooled.dispose()


# doctor on a plain server -----------------------------------------------------------------


@pytest.mark.slow  # the command line
def test_doctor_on_a_plain_server_passes(backend: Backend, engine: sa.Engine) -> None:
    result = run_cli("doctor", url=backend.url)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("self-test (")
    health = lines.index("table health:")
    assert health > 1, lines
    assert all(line.startswith("  passed  ") for line in lines[1:health]), lines
    assert lines[health + 1].startswith("  table health of "), lines


# The SQL each database gets, compiled (Oracle and MySQL 8 have no live server here) ----------


@pytest.mark.parametrize(
    ("dialect", "session"),
    [
        (sa.dialects.postgresql.psycopg.dialect(), "pg_backend_pid()"),
        (sa.dialects.mysql.pymysql.dialect(), "connection_id()"),
        (sa.dialects.oracle.oracledb.dialect(), "sys_context("),
    ],
    ids=["postgresql", "mysql", "oracle"],
)
def test_the_probe_locks_with_skip_locked_and_asks_for_the_session(dialect: sa.Dialect, session: str) -> None:
    from sa_taskqueue.backends import backend_for
    from sa_taskqueue.core.control import control_table_of
    from sa_taskqueue.health.self_test import _Probe
    from sa_taskqueue.strategies import SkipLockedStrategy

    probe = _Probe(control_table_of(tq.Task.__table__), "probe-x")  # type: ignore[arg-type]
    locking = SkipLockedStrategy().lock_rows(None, probe.select())  # type: ignore[arg-type]
    assert str(locking.compile(dialect=dialect)).endswith("FOR UPDATE SKIP LOCKED")
    call = backend_for(dialect).session_id()
    assert call is not None
    assert str(sa.select(call).compile(dialect=dialect)).lower().startswith(f"select {session}")
