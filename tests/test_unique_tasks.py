"""Unique tasks: one queued or running task per name and unique key, on every enqueue path and database.

The race runs real processes, each in its own transaction; the rest checks
the semantics (the key is freed when the task finishes, the caller's
transaction survives a clash) and the refusals.  The compile-only tests at
the end show the SQL sent where no server runs (Oracle) and where the
statement differs (MySQL's savepoint path against ON CONFLICT).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.features import unique
from tests.app import Execution, make_queue
from tests.backends import ASYNC_DRIVERS, Backend, async_url
from tests.helpers import listening, received, run_cli, task_rows, wait_until

ROOT = Path(__file__).resolve().parent.parent
TABLE = tq.Task.__table__
PROCESSES = 8


def keyed_rows(engine: sa.Engine) -> list[tuple[int, str, str | None, tq.TaskStatus]]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(TABLE.c.id, TABLE.c.name, TABLE.c.unique_key, TABLE.c.status).order_by(TABLE.c.id)
        ).all()
    return [(row.id, row.name, row.unique_key, row.status) for row in rows]


def business_rows(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(Execution.task_key).order_by(Execution.id)).scalars())


# The race --------------------------------------------------------------------------


def enqueue_in_race(url: str, ready: str, go: str) -> None:
    """One racer: open a transaction, wait for the start, enqueue key "race", commit, print the id."""
    engine = sa.create_engine(url, poolclass=NullPool)
    queue = make_queue(engine, None, timedelta(minutes=5))
    with Session(engine) as session:
        if engine.dialect.name != "sqlite":
            # A read first, as an application's transaction would make: on
            # MySQL it fixes the transaction's snapshot before any rival's
            # task commits, so the task holding the key must still be found.
            # (On SQLite a transaction that read first cannot take the write
            # lock once another process has written: that is SQLite's rule,
            # not the queue's, so the race starts with the enqueue there.)
            session.execute(sa.select(sa.func.count()).select_from(TABLE))
        Path(ready).touch()
        wait_until(Path(go).exists, 120, "the start signal", every=0.002)
        task = queue.enqueue(session, "record", {"key": os.getpid()}, unique_key="race")
        task_id = task.id
        # Held open a moment, so that rivals meet this row uncommitted.
        time.sleep(0.2)
        session.commit()
    engine.dispose()
    print(json.dumps({"id": task_id}))


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_processes_enqueueing_one_key_at_once_get_one_task(
    backend: Backend, engine: sa.Engine, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    readies = [tmp_path / f"ready-{n}" for n in range(PROCESSES)]
    code = "import sys; from tests.test_unique_tasks import enqueue_in_race as r; r(*sys.argv[1:])"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, backend.url, str(ready), str(go)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ready in readies
    ]
    try:
        wait_until(lambda: all(ready.exists() for ready in readies), 120, "the processes to start")
        go.touch()  # every process enqueues at once
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err  # no IntegrityError reached any of them
    ids = [json.loads(out)["id"] for out, _ in outputs]
    [(task_id, name, key, status)] = keyed_rows(engine)
    assert (name, key, status) == ("record", "race", tq.TaskStatus.QUEUED), "exactly one row"
    assert ids == [task_id] * PROCESSES, "and every process got its id"


# Semantics ------------------------------------------------------------------------


def test_a_clash_leaves_the_callers_transaction_usable(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    with Session(engine) as session:
        held = default_queue.enqueue(session, "record", {"key": 1}, unique_key="k")
        session.commit()
        held_id = held.id
    with Session(engine) as session:
        session.add(Execution(task_key=10, pid=0))
        session.flush()
        again = default_queue.enqueue(session, "record", {"key": 2}, unique_key="k")
        assert isinstance(again, tq.Task) and again in session, "the ORM task, loaded in the caller's session"
        assert (again.id, again.params) == (held_id, {"key": 1}), "the task holding the key, unchanged"
        session.add(Execution(task_key=11, pid=0))
        # In the same transaction as the first enqueue, too.
        fresh = default_queue.enqueue(session, "record", {"key": 3}, unique_key="other")
        assert default_queue.enqueue(session, "record", {"key": 4}, unique_key="other") is fresh
        fresh_id = fresh.id
        session.commit()
    assert business_rows(engine) == [10, 11], "the caller's rows before and after the clash committed"
    assert [(row.id, row.unique_key) for row in task_rows(engine)] == [(held_id, "k"), (fresh_id, "other")]


def finish_by_completing(queue: tq.TaskQueue, task_id: int) -> None:
    [claimed] = queue.claim()
    assert queue.complete(claimed)


def finish_by_failing(queue: tq.TaskQueue, task_id: int) -> None:
    [claimed] = queue.claim()
    assert queue.fail(claimed, "gave up", retry=False)


def finish_by_cancelling(queue: tq.TaskQueue, task_id: int) -> None:
    assert queue.cancel(task_id)


@pytest.mark.parametrize(
    "finish", [finish_by_completing, finish_by_failing, finish_by_cancelling], ids=lambda f: f.__name__
)
def test_the_key_is_held_while_queued_or_running_and_free_once_finished(
    engine: sa.Engine, default_queue: tq.TaskQueue, finish: Callable[[tq.TaskQueue, int], None]
) -> None:
    def enqueue(key: int) -> int:
        with Session(engine) as session:
            task_id = default_queue.enqueue(session, "record", {"key": key}, unique_key="k").id
            session.commit()
            return task_id

    first = enqueue(1)
    assert enqueue(2) == first, "held while queued"
    if finish is not finish_by_cancelling:
        [claimed] = default_queue.claim()
        assert enqueue(3) == first, "held while running"
        # A failure with attempts left goes back to the queue: still held.
        assert default_queue.fail(claimed, "again")
        assert enqueue(4) == first, "held while queued for a retry"
    with Session(engine) as session:  # due now, whatever the retry delay was
        session.execute(sa.update(TABLE).values(run_at=default_queue.clock()))
        session.commit()
    finish(default_queue, first)
    second = enqueue(5)
    assert second != first, "free once finished"
    assert [row.params["key"] for row in task_rows(engine)] == [1, 5]


def test_names_keep_their_keys_apart_and_unique_by_derives_the_key(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    # Non-ASCII in the name and the key: the database's LENGTH in the index
    # (bytes on MySQL, characters elsewhere) must match the holder's lookup.
    @default_queue.task(name="résumé", unique_by=("user_id", "kind"))
    def resume(user_id: int, kind: str, note: str = "") -> None: ...

    @default_queue.task(name="other", unique_by=("user_id", "kind"))
    def other(user_id: int, kind: str) -> None: ...

    with Session(engine) as session:
        first = resume.enqueue(session, user_id=7, kind="clé", note="a")
        assert first.unique_key == '{"kind":"clé","user_id":7}', "canonical JSON: keys sorted, no spaces"
        assert resume.enqueue(session, kind="clé", user_id=7, note="b") is first, "other params do not count"
        assert resume.enqueue(session, user_id=8, kind="clé") is not first
        assert other.enqueue(session, user_id=7, kind="clé") is not first, "another name, the same key"
        # An explicit key wins over the derived one.
        explicit = resume.using(unique_key="mine").enqueue(session, user_id=7, kind="clé")
        assert explicit.unique_key == "mine" and explicit is not first
        assert (
            default_queue.enqueue(session, "résumé", {"user_id": 1, "kind": "x"}, unique_key="mine")
            is explicit
        )
        session.commit()
    assert len(task_rows(engine)) == 4


def test_a_derived_key_longer_than_the_column_is_hashed() -> None:
    short = unique.derive_key(("a",), {"a": "x"}, "t", 255)
    assert short == '{"a":"x"}'
    long = unique.derive_key(("a",), {"a": "x" * 300}, "t", 255)
    assert long.startswith("sha256:") and len(long) == len("sha256:") + 64
    assert long == unique.derive_key(("a",), {"a": "x" * 300}, "t", 255), "stable"


def test_using_carries_the_key_to_enqueue_and_enqueue_many(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    record = default_queue.registered("record")
    assert record is not None
    keyed = record.using(unique_key="once", priority=3)
    assert "unique_key='once'" in repr(keyed)
    with Session(engine) as session:
        task = keyed.enqueue(session, key=1)
        assert keyed.using(priority=5).enqueue(session, key=2) is task, "kept by a narrower using()"
        assert keyed.enqueue_many(session, [{"key": 3}]) == [task.id]
        with pytest.raises(ValueError, match="unique_key gives 2 rows one key"):
            keyed.enqueue_many(session, [{"key": 3}, {"key": 4}])
        session.commit()
    [row] = task_rows(engine)
    assert (row.unique_key, row.priority, row.params) == ("once", 3, {"key": 1})


def test_enqueue_many_gives_one_task_per_key_and_ids_in_input_order(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    @default_queue.task(name="sync_user", unique_by=("user_id",))
    def sync_user(user_id: int, reason: str = "") -> None: ...

    with Session(engine) as session:
        held = sync_user.enqueue(session, user_id=3)
        session.commit()
        held_id = held.id
    with Session(engine) as session:
        session.add(Execution(task_key=1, pid=0))
        rows = [{"user_id": 1}, {"user_id": 2, "reason": "a"}, {"user_id": 1, "reason": "b"}, {"user_id": 3}]
        ids = default_queue.enqueue_many(session, "sync_user", rows)
        session.commit()
    assert ids is not None, "keyed rows return their ids on every database"
    assert ids[0] == ids[2] and ids[3] == held_id and len(set(ids)) == 3
    by_id = {row.id: row for row in task_rows(engine)}
    assert sorted(by_id) == sorted(set(ids))
    assert [by_id[task_id].params["user_id"] for task_id in ids] == [1, 2, 1, 3]
    assert by_id[ids[0]].params == {"user_id": 1}, "the first row of a key is the one written"
    assert business_rows(engine) == [1]


def test_an_async_session_enqueue_returns_the_task_holding_the_key(
    request: pytest.FixtureRequest, backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    driver = request.config.getoption("--async-driver") or ASYNC_DRIVERS[backend.name][0]
    async_engine = create_async_engine(async_url(backend.url, driver), poolclass=NullPool)

    async def enqueue_twice() -> tuple[int, int, bool]:
        try:
            async with AsyncSession(async_engine) as session:
                first = await default_queue.enqueue(session, "record", {"key": 1}, unique_key="k")
                session.add(Execution(task_key=5, pid=0))
                second = await default_queue.enqueue(session, "record", {"key": 2}, unique_key="k")
                ids = (first.id, second.id, first is second)
                await session.commit()
                return ids
        finally:
            await async_engine.dispose()

    first_id, second_id, same = asyncio.run(enqueue_twice())
    assert first_id == second_id and same
    assert [row.id for row in task_rows(engine)] == [first_id]
    assert business_rows(engine) == [5]


def test_what_a_keyed_enqueue_sends(backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue) -> None:
    sent: list[str] = []

    def record(conn: sa.Connection, cursor: Any, statement: str, *args: Any) -> None:
        words = statement.split()
        sent.append(
            "NOTIFY"
            if "pg_notify" in statement
            else " ".join(words[:2] if words[0] == "ROLLBACK" else words[:1])
        )

    with Session(engine) as session:
        session.connection()  # (the BEGIN, and a first connect's own queries, are not counted)
        sa.event.listen(engine, "before_cursor_execute", record)
        try:
            default_queue.enqueue(session, "record", {"key": 1}, unique_key="k")
            fresh = list(sent)
            sent.clear()
            default_queue.enqueue(session, "record", {"key": 2}, unique_key="k")
            clash = list(sent)
        finally:
            sa.event.remove(engine, "before_cursor_execute", record)
        session.rollback()
    if backend.is_mysql_family:
        # A savepoint around the INSERT, then the new row read by its id
        # (with a shared lock, as the clash's read of the holder).
        assert fresh == ["SAVEPOINT", "INSERT", "RELEASE", "SELECT"]
        assert clash == ["SAVEPOINT", "INSERT", "ROLLBACK TO", "SELECT"]
    else:
        # The INSERT returns the new row itself; on PostgreSQL a NOTIFY follows.
        assert fresh == (["INSERT", "NOTIFY"] if backend.is_postgres else ["INSERT"])
        assert clash == ["INSERT", "SELECT"], "and a clash reads the holder once"


@pytest.mark.backends("postgres")
def test_a_holder_finishing_between_the_clash_and_the_read_frees_the_key(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    # Only PostgreSQL lets this happen: ON CONFLICT DO NOTHING locks nothing,
    # and each statement reads the latest commits.  MySQL keeps a shared
    # lock on the duplicate index entry, and SQLite the write lock, until
    # the enqueueing transaction ends, so the holder cannot finish meanwhile.
    with Session(engine) as session:
        holder = default_queue.enqueue(session, "record", {"key": 1}, unique_key="k").id
        session.commit()
    finished: list[str] = []

    def finish_the_holder_first(
        conn: sa.Connection, cursor: Any, statement: str, params: Any, context: Any, many: bool
    ) -> None:
        if not finished and statement.startswith("SELECT") and "active_unique_key =" in statement:
            finished.append(statement)
            with engine.begin() as other:  # another connection, committed before the read runs
                other.execute(
                    sa.update(TABLE)
                    .where(TABLE.c.id == holder)
                    .values(status=tq.TaskStatus.COMPLETED, finished_at=default_queue.clock())
                )

    sa.event.listen(engine, "before_cursor_execute", finish_the_holder_first)
    try:
        with Session(engine) as session:
            task = default_queue.enqueue(session, "record", {"key": 2}, unique_key="k")
            task_id = task.id
            session.commit()
    finally:
        sa.event.remove(engine, "before_cursor_execute", finish_the_holder_first)
    assert finished, "the holder finished after the clash"
    assert task_id != holder, "the key was taken by a new task on the next try"
    assert [(row.id, row.status) for row in task_rows(engine)] == [
        (holder, tq.TaskStatus.COMPLETED),
        (task_id, tq.TaskStatus.QUEUED),
    ]


@pytest.mark.backends("sqlite", "mysql", "mariadb")
def test_a_database_without_insert_returning_gets_the_ids_too(backend: Backend, engine: sa.Engine) -> None:
    # MySQL 8 (and SQLite before 3.35) have no INSERT ... RETURNING: the new
    # id comes from the cursor, and on SQLite a skipped row from its rowcount.
    plain = sa.create_engine(backend.url, poolclass=NullPool)
    with plain.connect():
        pass  # the dialect learns its server, then is told RETURNING is not there
    plain.dialect.insert_returning = False
    queue = make_queue(plain, None, timedelta(minutes=5))

    @queue.task(name="keyed", unique_by=("group",))
    def keyed(group: str, n: int) -> None: ...

    try:
        with Session(plain) as session:
            first = queue.enqueue(session, "record", {"key": 1}, unique_key="k")
            assert queue.enqueue(session, "record", {"key": 2}, unique_key="k") is first
            ids = queue.enqueue_many(session, "keyed", [{"group": "m", "n": 3}, {"group": "m", "n": 4}])
            first_id = first.id
            session.commit()
    finally:
        plain.dispose()
    assert ids is not None and ids[0] == ids[1] != first_id
    assert [row.id for row in task_rows(engine)] == [first_id, ids[0]]


@pytest.mark.backends("postgres")
def test_a_clash_sends_no_notify(backend: Backend, engine: sa.Engine, default_queue: tq.TaskQueue) -> None:
    with listening(backend, TABLE) as listener:
        with Session(engine) as session:
            default_queue.enqueue(session, "record", {"key": 1}, unique_key="k")
            session.commit()
        assert received(listener) == ["default"]
        with Session(engine) as session:
            default_queue.enqueue(session, "record", {"key": 2}, unique_key="k")
            session.commit()
        assert received(listener) == [], "nothing was written, no worker is woken"


def test_the_command_line_enqueues_once_per_key(backend: Backend, engine: sa.Engine) -> None:
    def enqueue(*options: str) -> subprocess.CompletedProcess[str]:
        return run_cli("enqueue", "record", "--params", '{"key": 1}', *options, url=backend.url)

    first = enqueue("--unique-key", "nightly")
    assert first.returncode == 0, first.stderr
    [row] = task_rows(engine)
    assert f"enqueued task {row.id} (record)" in first.stdout and row.unique_key == "nightly"
    again = enqueue("--unique-key", "nightly")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        f"task {row.id} (record) is queued or running with unique key 'nightly': nothing enqueued"
    )
    assert len(task_rows(engine)) == 1


# Refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "error", "message"),
    [
        ("", ValueError, "unique_key must be a non-empty string of at most 255 characters"),
        ("k" * 256, ValueError, "unique_key must be a non-empty string of at most 255 characters"),
        ("a\x00b", ValueError, "unique_key holds a NUL character"),
        ("a\ud800", ValueError, "unique_key holds an unpaired surrogate"),
        (5, TypeError, "unique_key must be a string, got int"),
    ],
)
def test_a_bad_unique_key_is_refused_before_any_sql(
    engine: sa.Engine, default_queue: tq.TaskQueue, key: Any, error: type[Exception], message: str
) -> None:
    record = default_queue.registered("record")
    assert record is not None
    with Session(engine) as session:
        session.add(Execution(task_key=1, pid=0))
        with pytest.raises(error, match=message):
            default_queue.enqueue(session, "record", {"key": 1}, unique_key=key)
        with pytest.raises(error, match=message):
            default_queue.enqueue_many(session, "record", [{"key": 1}], unique_key=key)
        with pytest.raises(error, match=message):
            record.using(unique_key=key)
        session.commit()  # still usable
    assert task_rows(engine) == []
    assert business_rows(engine) == [1]


def test_a_bad_unique_by_is_refused_at_registration(default_queue: tq.TaskQueue) -> None:
    def send(user_id: int, *args: int, **options: int) -> None: ...

    def plain(user_id: int, /, kind: str, *, when: str = "") -> None: ...

    with pytest.raises(
        TypeError, match=r"unique_by must be a tuple of parameter names.*unique_by=\('user_id',\)"
    ):
        default_queue.task(name="a", unique_by="user_id")(plain)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unique_by must name at least one parameter"):
        default_queue.task(name="a", unique_by=())(plain)
    with pytest.raises(ValueError, match="names a parameter twice"):
        default_queue.task(name="a", unique_by=("kind", "kind"))(plain)
    with pytest.raises(
        ValueError, match=r"unique_by of task 'a' names 'user_id', which the function does not take"
    ):
        default_queue.task(name="a", unique_by=("user_id",))(plain)  # positional-only
    with pytest.raises(ValueError, match=r"names 'nope'.*it takes: kind, when"):
        default_queue.task(name="a", unique_by=("kind", "nope"))(plain)
    assert default_queue.registered("a") is None, "nothing was registered"
    # **options takes any keyword.
    assert default_queue.task(name="b", unique_by=("user_id", "channel"))(send).options.unique_by == (
        "user_id",
        "channel",
    )


def test_a_param_unique_by_names_must_be_passed(engine: sa.Engine, default_queue: tq.TaskQueue) -> None:
    @default_queue.task(name="report", unique_by=("day",))
    def report(day: str = "today") -> None: ...

    with Session(engine) as session:
        with pytest.raises(
            ValueError, match=r"params of task 'report' lack 'day', which its unique_by names"
        ):
            report.enqueue(session)
        with pytest.raises(ValueError, match="lack 'day'"):
            default_queue.enqueue_many(session, "report", [{"day": "mon"}, {}])
        session.commit()
    assert task_rows(engine) == []


def test_the_index_refuses_a_second_active_row_added_with_session_add(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    with Session(engine) as session:
        session.add(tq.Task(name="record", params={"key": 1}, unique_key="k"))
        session.commit()
    with Session(engine) as session:
        session.add(tq.Task(name="record", params={"key": 2}, unique_key="k"))
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        session.rollback()
    # Checked like the other columns before the flush, too.
    with Session(engine) as session:
        session.add(tq.Task(name="record", params={"key": 3}, unique_key=""))
        with pytest.raises(ValueError, match="unique_key must be a non-empty string"):
            session.flush()
    assert [row.params for row in task_rows(engine)] == [{"key": 1}]


# The SQL per database ------------------------------------------------------------


VALUES = {"name": "t", "params": {}, "queue": "default", "unique_key": "k"}


def compiled(statement: Any, dialect: sa.engine.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())


@pytest.mark.parametrize("dialect", [postgresql.dialect(), sqlite.dialect()], ids=["postgresql", "sqlite"])
def test_postgres_and_sqlite_skip_the_clash_in_the_insert(dialect: sa.engine.Dialect) -> None:
    text = compiled(unique.insert_statement(dialect, TABLE, VALUES), dialect)
    assert text.startswith("INSERT INTO sa_taskqueue_task")
    assert re.search(
        r" ON CONFLICT \(active_unique_key\) WHERE active_unique_key IS NOT NULL DO NOTHING "
        r"RETURNING (sa_taskqueue_task\.)?id$",
        text,
    ), text


def mysql_dialect(*, mariadb: bool = False, version: tuple[int, ...] = (8, 0, 36)) -> sa.engine.Dialect:
    dialect = mysql.dialect()
    dialect.server_version_info = version
    dialect.is_mariadb = mariadb
    return dialect


@pytest.mark.parametrize(
    "dialect",
    [oracle.dialect(), mysql_dialect(), mysql_dialect(mariadb=True, version=(10, 11, 9))],
    ids=["oracle", "mysql", "mariadb"],
)
def test_mysql_and_oracle_insert_plainly_inside_a_savepoint(dialect: sa.engine.Dialect) -> None:
    backend = backend_for(dialect)
    assert not backend.insert_skips_conflicts, "a SAVEPOINT around a plain INSERT"
    text = compiled(unique.insert_statement(dialect, TABLE, VALUES, tq.Task), dialect)
    assert text.startswith("INSERT INTO sa_taskqueue_task (")
    assert "IGNORE" not in text and "ON DUPLICATE" not in text and "ON CONFLICT" not in text, text
    # Only the new id comes back (the task is read by it): RETURNING INTO on
    # Oracle and MariaDB's RETURNING, the cursor's last id on MySQL.
    if dialect.insert_returning:
        assert re.search(r"\) RETURNING sa_taskqueue_task\.id( INTO :\w+)?$", text), text
    else:
        assert "RETURNING" not in text and text.endswith(")"), text


def test_the_holder_is_read_through_the_index_with_the_columns_own_expression() -> None:
    text = compiled(unique.holder_statement(oracle.dialect(), TABLE, "t", "k"), oracle.dialect())
    assert re.fullmatch(
        r"SELECT sa_taskqueue_task\.id FROM sa_taskqueue_task WHERE sa_taskqueue_task\.active_unique_key = "
        r"\(CAST\(length\(:param_1\) AS VARCHAR2\(10 CHAR\)\) \|\| :param_2 \|\| :param_1 \|\| :param_3\)",
        text,
    ), text
    # MySQL's REPEATABLE READ snapshot may predate the holder's commit: a locking read sees it.
    mariadb = compiled(
        unique.holder_statement(mysql_dialect(mariadb=True), TABLE, "t", "k"), mysql_dialect(mariadb=True)
    )
    assert mariadb.endswith("LOCK IN SHARE MODE"), mariadb
    # (MySQL 8 servers get FOR SHARE once connected; both are shared locks.)
    assert compiled(unique.holder_statement(mysql_dialect(), TABLE, "t", "k"), mysql_dialect()).endswith(
        ("FOR SHARE", "LOCK IN SHARE MODE")
    )
    assert "FOR" not in compiled(
        unique.holder_statement(postgresql.dialect(), TABLE, "t", "k"), postgresql.dialect()
    )


class FakeDriverError(Exception):
    pass


def test_only_a_duplicate_in_the_unique_key_index_counts_as_a_clash() -> None:
    index = unique.index_name(TABLE)
    assert index == "ux_sa_taskqueue_task_unique"
    maria = backend_for(mysql_dialect(mariadb=True))
    assert maria.duplicate_key(FakeDriverError(1062, f"Duplicate entry '1:tk' for key '{index}'"), index)
    assert maria.duplicate_key(
        FakeDriverError(1062, f"Duplicate entry '1:tk' for key 'sa_taskqueue_task.{index}'"), index
    )
    assert not maria.duplicate_key(FakeDriverError(1062, "Duplicate entry '5' for key 'PRIMARY'"), index)
    assert not maria.duplicate_key(FakeDriverError(1048, f"Column 'name' cannot be null ({index})"), index)
    ora = backend_for(oracle.dialect())
    assert ora.duplicate_key(
        FakeDriverError(f"ORA-00001: unique constraint (APP.{index.upper()}) violated"), index
    )
    assert not ora.duplicate_key(
        FakeDriverError("ORA-00001: unique constraint (APP.SYS_C0012) violated"), index
    )
    assert not ora.duplicate_key(FakeDriverError(f"ORA-12899: value too large ({index.upper()})"), index)


def test_a_retry_leaves_a_task_whose_key_another_holds_failed(
    engine: sa.Engine, default_queue: tq.TaskQueue
) -> None:
    from sa_taskqueue.features.admin import Admin

    def failed(key: str, n: int) -> int:
        with Session(engine) as session:
            task_id = default_queue.enqueue(session, "record", {"key": n}, unique_key=key).id
            session.commit()
        with engine.begin() as conn:
            conn.execute(sa.update(TABLE).where(TABLE.c.id == task_id).values(status=tq.TaskStatus.FAILED))
        return task_id

    first, second = failed("k", 1), failed("k", 2)  # a key is free again once its task failed
    admin = Admin(engine)
    assert admin.retry(None) == 1, "of two failed tasks sharing a key, one takes it again"
    statuses = {row.id: row.status for row in task_rows(engine)}
    assert (statuses[first], statuses[second]) == (tq.TaskStatus.QUEUED, tq.TaskStatus.FAILED)
    assert admin.retry(second) == 0, "its key is held by the first, queued again"
    assert {row.id: row.status for row in task_rows(engine)}[second] == tq.TaskStatus.FAILED
