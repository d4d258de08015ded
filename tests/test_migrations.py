"""The Alembic migrations create exactly the schema `sa_taskqueue.metadata` declares.

Two independent checks, because neither is enough alone:

* alembic's own ``compare_metadata`` (what ``alembic check`` and autogenerate
  use), with the same `include_object` hook as ``alembic/env.py``;
* the migrated table reflected, column by column and index by index, against
  the same table made by ``metadata.create_all``.  Alembic does not compare
  partial-index predicates (``postgresql_where`` / ``sqlite_where``), MySQL's
  DATETIME fractional-second precision, or PostgreSQL IDENTITY against
  BIGSERIAL, so a migration that lost ``WHERE status = 'queued'``, ``fsp=6``
  or ``Identity()`` would pass the first check alone.

Both run under every URL form a backend can be reached by, each against
``create_all`` under that same form: SQLAlchemy names the dialect after the
URL (``mariadb://`` gives "mariadb", ``mysql://`` gives "mysql" even on a
MariaDB server), and a type chosen by dialect name can differ between them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.dialects import mysql

import sa_taskqueue
from sa_taskqueue.core import migrate
from sa_taskqueue.core.model import FINISHED_STATUSES, TaskStatus
from tests.backends import Backend

REPO_ROOT = Path(__file__).resolve().parent.parent
TASK_TABLE = "sa_taskqueue_task"
CONTROL_TABLE = "sa_taskqueue_task_control"
WORKER_TABLE = "sa_taskqueue_task_workers"
RATE_LIMIT_TABLE = "sa_taskqueue_task_rate_limits"
DEPENDENCY_TABLE = "sa_taskqueue_task_dependencies"
BATCH_TABLE = "sa_taskqueue_task_batches"

#: Every status a task could have before the workflows' revision added ``waiting``.
STATUSES_BEFORE_WORKFLOWS = tuple(status for status in TaskStatus if status is not TaskStatus.WAITING)

#: The revision that creates the table; later ones change it.
FIRST_REVISION = "b78c74731220"

#: The drivernames a server is reached by, for backends named after their
#: database ("postgres", "postgres18", ...).  A plain ``postgresql://`` means
#: whichever driver SQLAlchemy defaults to (psycopg2 in 2.0, psycopg in 2.1);
#: ``mariadb://`` only connects to a MariaDB server.  Any other backend is
#: tested under its own URL only.
URL_FORMS: dict[str, tuple[str, ...]] = {
    "sqlite": ("sqlite",),
    "postgres": ("postgresql", "postgresql+psycopg"),
    "mysql": ("mysql+pymysql", "mariadb+pymysql"),
    "mariadb": ("mysql+pymysql", "mariadb+pymysql"),
    "oracle": ("oracle+oracledb",),
}
AS_CONFIGURED = "as-configured"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "url_form" in metafunc.fixturenames:
        name: str = metafunc.config.getoption("--backend")
        forms = next(
            (forms for database, forms in URL_FORMS.items() if name.startswith(database)), (AS_CONFIGURED,)
        )
        metafunc.parametrize("url_form", forms, indirect=True, ids=forms)


def _drop_everything(engine: sa.Engine) -> None:
    sa_taskqueue.metadata.drop_all(engine)
    with engine.begin() as connection:
        sa.Table(migrate.VERSION_TABLE, sa.MetaData()).drop(connection, checkfirst=True)


@pytest.fixture
def clean_database(engine: sa.Engine) -> Iterator[None]:
    """No task table and no version table; afterwards, the tables other tests expect."""
    _drop_everything(engine)
    try:
        yield
    finally:
        engine.dispose()  # forget connections that saw the schema a subprocess changed
        _drop_everything(engine)
        sa_taskqueue.metadata.create_all(engine)


@pytest.fixture
def url_form(request: pytest.FixtureRequest, backend: Backend, engine: sa.Engine) -> str:
    """The backend's URL with the drivername under test (the database, user and host unchanged)."""
    url = sa.make_url(backend.url)
    drivername: str = url.drivername if request.param == AS_CONFIGURED else request.param
    url = url.set(drivername=drivername)
    try:
        url.get_dialect().import_dbapi()
    except ImportError as error:
        pytest.skip(f"{drivername}:// needs the {error.name} driver, which is not installed")
    if drivername.startswith("mariadb"):
        with engine.connect():  # the dialect learns what the server is on first connect
            pass
        if not getattr(engine.dialect, "is_mariadb", False):
            pytest.skip("mariadb:// refuses a MySQL server")
    return url.render_as_string(hide_password=False)


@pytest.fixture
def form_engine(url_form: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(url_form, poolclass=sa.pool.NullPool)
    yield engine
    engine.dispose()


def _run_module(module: str, url: str, *args: str) -> None:
    """Run ``python -m module`` from the repository root, as a developer would."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={**os.environ, "SA_TASKQUEUE_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"{module} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def _alembic(url: str, *args: str) -> None:
    """The alembic command line, pointed at `url` by the environment."""
    _run_module("alembic", url, *args)


def _sa_taskqueue(url: str, *args: str) -> None:
    """The sa-taskqueue command line."""
    _run_module("sa_taskqueue", url, *args)


def _head_revision() -> str | None:
    return ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()


def _current_revision(connection: sa.Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": migrate.VERSION_TABLE})
    return context.get_current_revision()


def _schema_diff(connection: sa.Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"include_object": migrate.include_object})
    return list(compare_metadata(context, sa_taskqueue.metadata))


def _reflect(engine: sa.Engine) -> dict[str, Any]:
    """The task table and its control table as the database reports them, in comparable form."""
    tables = {TASK_TABLE: _reflect_table(engine, TASK_TABLE)}
    for extra in (CONTROL_TABLE, WORKER_TABLE, RATE_LIMIT_TABLE, DEPENDENCY_TABLE, BATCH_TABLE):
        if sa.inspect(engine).has_table(extra):
            tables[extra] = _reflect_table(engine, extra)
    return tables


def _reflect_table(engine: sa.Engine, table_name: str) -> dict[str, Any]:
    """One table as the database reports it, in comparable (repr'd) form."""
    inspector = sa.inspect(engine)
    return {
        "columns": [
            {key: repr(value) for key, value in sorted(column.items())}
            for column in inspector.get_columns(table_name)
        ],
        "primary_key": inspector.get_pk_constraint(table_name),
        "indexes": sorted(
            (
                {key: repr(value) for key, value in sorted(index.items()) if key != "dialect_options"}
                | {
                    f"dialect_options.{key}": str(value)
                    for key, value in sorted(index.get("dialect_options", {}).items())
                }
                for index in inspector.get_indexes(table_name)
            ),
            key=lambda index: index["name"],
        ),
        "unique_constraints": inspector.get_unique_constraints(table_name),
        "foreign_keys": inspector.get_foreign_keys(table_name),
        "check_constraints": sorted(
            (str(check.get("sqltext")) for check in inspector.get_check_constraints(table_name)),
        ),
    }


def _assert_head_matches_model(engine: sa.Engine, downgrade: Callable[[], None]) -> None:
    """The table migrated to head at `engine` is the model's, by both checks; `downgrade` removes it.

    The comparison table is made by ``create_all`` through `engine` too, so
    both sides see the dialect the same URL form gives.
    """
    engine.dispose()  # forget connections that saw the schema before the migration
    with engine.connect() as connection:
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()
    migrated = _reflect(engine)

    downgrade()
    engine.dispose()
    assert not sa.inspect(engine).has_table(TASK_TABLE)
    assert not sa.inspect(engine).has_table(CONTROL_TABLE)
    assert not sa.inspect(engine).has_table(WORKER_TABLE)
    assert not sa.inspect(engine).has_table(RATE_LIMIT_TABLE)
    assert not sa.inspect(engine).has_table(DEPENDENCY_TABLE)
    assert not sa.inspect(engine).has_table(BATCH_TABLE)

    # The same table made from the model, reflected the same way.
    sa_taskqueue.metadata.create_all(engine)
    assert migrated == _reflect(engine)


@pytest.mark.usefixtures("clean_database")
def test_alembic_upgrade_head_matches_metadata_and_downgrade_removes_it(
    backend: Backend, engine: sa.Engine
) -> None:
    had_application_version_table = sa.inspect(engine).has_table("alembic_version")

    _alembic(backend.url, "upgrade", "head")
    engine.dispose()
    # Our history went to our own version table, not the application's.
    assert sa.inspect(engine).has_table("alembic_version") == had_application_version_table

    _assert_head_matches_model(engine, lambda: _alembic(backend.url, "downgrade", "base"))


@pytest.mark.usefixtures("clean_database")
def test_migrate_upgrade_creates_the_table(backend: Backend, engine: sa.Engine) -> None:
    migrate.upgrade(backend.url)
    engine.dispose()
    assert sa.inspect(engine).has_table(TASK_TABLE)

    _assert_head_matches_model(engine, lambda: migrate.downgrade(backend.url))


@pytest.mark.usefixtures("clean_database")
def test_cli_migrate_matches_the_model_under_every_url_form(url_form: str, form_engine: sa.Engine) -> None:
    _sa_taskqueue(url_form, "migrate", "--url", url_form)

    _assert_head_matches_model(form_engine, lambda: migrate.downgrade(url_form))


def _column(engine: sa.Engine, name: str) -> Any:
    return next(column for column in sa.inspect(engine).get_columns(TASK_TABLE) if column["name"] == name)


#: The column type last_error must have, as reflected, by SQLAlchemy dialect
#: name: the model and the migrations could agree on a wrong type, and the
#: parity checks above would not see it.  Tables made by earlier releases have
#: these types too.
LAST_ERROR_TYPES = {
    "sqlite": "TEXT",
    "postgresql": "TEXT",
    "mysql": "MEDIUMTEXT",
    "mariadb": "MEDIUMTEXT",
    "oracle": "CLOB",
}


@pytest.mark.usefixtures("clean_database")
def test_last_error_has_the_databases_long_text_type_under_every_url_form(
    url_form: str, form_engine: sa.Engine
) -> None:
    migrate.upgrade(url_form)
    form_engine.dispose()
    reflected = type(_column(form_engine, "last_error")["type"]).__name__
    assert reflected == LAST_ERROR_TYPES[form_engine.dialect.name]


#: The schema sa_taskqueue 0.1 installed: the last revision before the scheduling controls.
RELEASE_0_1 = "b2b218417438"

#: The columns of the 0.1 table, which upgrades and downgrades must keep as they are.
COLUMNS_0_1 = (
    "id", "name", "queue", "priority", "params", "status", "run_at", "attempts", "max_attempts",
    "created_at", "started_at", "finished_at", "locked_by", "locked_until", "last_error", "result",
)  # fmt: skip


@pytest.mark.usefixtures("clean_database")
def test_upgrading_the_0_1_schema_keeps_every_task_and_downgrading_restores_it(
    url_form: str, form_engine: sa.Engine
) -> None:
    migrate.upgrade(url_form, RELEASE_0_1)
    form_engine.dispose()
    schema_0_1 = _reflect(form_engine)
    task = sa_taskqueue.metadata.tables[TASK_TABLE]
    old_columns = [task.c[name] for name in COLUMNS_0_1]
    now = datetime.now(UTC)
    rows = [
        {
            "name": f"tests.{status.value}", "queue": "default", "priority": index, "params": {"n": index},
            "status": status, "run_at": now, "attempts": 1, "max_attempts": 3, "created_at": now,
            "finished_at": now if status in FINISHED_STATUSES else None,
            "locked_by": "host:1:ab" if status is TaskStatus.RUNNING else None,
            "locked_until": now if status is TaskStatus.RUNNING else None,
            "last_error": "ValueError: kaput" if status is TaskStatus.FAILED else None,
            "result": {"ok": True} if status is TaskStatus.COMPLETED else None,
        }
        for index, status in enumerate(STATUSES_BEFORE_WORKFLOWS)
    ]  # fmt: skip
    with form_engine.begin() as connection:
        connection.execute(task.insert(), rows)
        before = connection.execute(sa.select(*old_columns).order_by(task.c.id)).all()
    assert {row.status for row in before} == set(STATUSES_BEFORE_WORKFLOWS)

    migrate.upgrade(url_form)
    form_engine.dispose()
    with form_engine.connect() as connection:
        assert connection.execute(sa.select(*old_columns).order_by(task.c.id)).all() == before
        assert connection.execute(sa.select(task.c.unique_key, task.c.active_unique_key)).all() == [
            (None, None)
        ] * len(before)
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()

    migrate.downgrade(url_form, RELEASE_0_1)
    form_engine.dispose()
    assert _reflect(form_engine) == schema_0_1
    assert not sa.inspect(form_engine).has_table(CONTROL_TABLE)
    with form_engine.connect() as connection:
        assert connection.execute(sa.select(*old_columns).order_by(task.c.id)).all() == before


@pytest.mark.backends("mysql", "mariadb")
@pytest.mark.usefixtures("clean_database")
@pytest.mark.parametrize(
    ("installed_type", "upgraded_type"),
    [
        # What the first revision used to create under a mariadb:// URL.
        ("TEXT", mysql.MEDIUMTEXT),
        # Wider than the model asks for: never narrowed.
        ("LONGTEXT", mysql.LONGTEXT),
    ],
)
def test_upgrade_widens_last_error_to_mediumtext_and_keeps_the_tasks(
    url_form: str, form_engine: sa.Engine, installed_type: str, upgraded_type: type[Any]
) -> None:
    migrate.upgrade(url_form, FIRST_REVISION)
    task = sa_taskqueue.metadata.tables[TASK_TABLE]
    old_columns = [task.c[name] for name in COLUMNS_0_1]
    with form_engine.begin() as connection:
        connection.execute(sa.text(f"ALTER TABLE {TASK_TABLE} MODIFY last_error {installed_type} NULL"))
    assert type(_column(form_engine, "last_error")["type"]).__name__ == installed_type
    with form_engine.begin() as connection:
        connection.execute(
            task.insert(),
            [
                {"name": "short", "last_error": "ValueError: kaput"},
                {"name": "none", "last_error": None},
                {"name": "near the TEXT limit", "last_error": "x" * 60_000},
            ],
        )
        before = connection.execute(sa.select(*old_columns).order_by(task.c.id)).all()

    migrate.upgrade(url_form)
    form_engine.dispose()

    last_error = _column(form_engine, "last_error")
    assert type(last_error["type"]) is upgraded_type
    assert last_error["nullable"] is True
    with form_engine.begin() as connection:
        assert connection.execute(sa.select(*old_columns).order_by(task.c.id)).all() == before
        # More than TEXT's 64 KiB now fits, whole.
        longer = "y" * 100_000
        connection.execute(task.update().where(task.c.id == before[0].id).values(last_error=longer))
        assert connection.scalar(sa.select(task.c.last_error).where(task.c.id == before[0].id)) == longer
        assert _current_revision(connection) == _head_revision()
        if upgraded_type is mysql.MEDIUMTEXT:
            assert _schema_diff(connection) == []

    # Downgrading leaves the column as wide as it is, then base drops the table.
    migrate.downgrade(url_form, FIRST_REVISION)
    form_engine.dispose()
    assert type(_column(form_engine, "last_error")["type"]) is upgraded_type
    migrate.downgrade(url_form)
    form_engine.dispose()
    assert not sa.inspect(form_engine).has_table(TASK_TABLE)


#: The scheduling controls' revision: the head before live workers and task headers.
SCHEDULING_CONTROLS = "c41d7e2a9f10"


@pytest.mark.usefixtures("clean_database")
def test_upgrading_from_the_scheduling_controls_adds_the_later_columns_and_worker_table_keeping_every_task(
    url_form: str, form_engine: sa.Engine
) -> None:
    migrate.upgrade(url_form, SCHEDULING_CONTROLS)
    form_engine.dispose()
    schema_before = _reflect(form_engine)
    assert not sa.inspect(form_engine).has_table(WORKER_TABLE)
    task = sa_taskqueue.metadata.tables[TASK_TABLE]
    kept = [task.c[name] for name in (*COLUMNS_0_1, "unique_key", "concurrency_key", "concurrency_slot")]
    now = datetime.now(UTC)
    rows = [
        {
            "name": f"tests.{status.value}", "queue": "default", "priority": index, "params": {"n": index},
            "status": status, "run_at": now, "attempts": 1, "max_attempts": 3, "created_at": now,
            "finished_at": now if status in FINISHED_STATUSES else None,
            "locked_by": "host:1:ab" if status is TaskStatus.RUNNING else None,
            "locked_until": now if status is TaskStatus.RUNNING else None,
            "last_error": "ValueError: kaput" if status is TaskStatus.FAILED else None,
            "result": {"ok": True} if status is TaskStatus.COMPLETED else None,
            "unique_key": f"u{index}", "concurrency_key": "k",
            "concurrency_slot": 0 if status is TaskStatus.RUNNING else None,
        }
        for index, status in enumerate(STATUSES_BEFORE_WORKFLOWS)
    ]  # fmt: skip
    with form_engine.begin() as connection:
        connection.execute(task.insert(), rows)
        before = connection.execute(sa.select(*kept).order_by(task.c.id)).all()
    assert {row.status for row in before} == set(STATUSES_BEFORE_WORKFLOWS)

    migrate.upgrade(url_form)
    form_engine.dispose()
    with form_engine.connect() as connection:
        assert connection.execute(sa.select(*kept).order_by(task.c.id)).all() == before
        assert connection.execute(sa.select(task.c.headers)).scalars().all() == [None] * len(before)
        assert connection.execute(
            sa.select(task.c.cancel_requested_at, task.c.cancelled_by, task.c.progress, task.c.progress_note)
        ).all() == [(None, None, None, None)] * len(before)
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()
    assert sa.inspect(form_engine).has_table(WORKER_TABLE)

    migrate.downgrade(url_form, SCHEDULING_CONTROLS)
    form_engine.dispose()
    assert _reflect(form_engine) == schema_before
    with form_engine.connect() as connection:
        assert connection.execute(sa.select(*kept).order_by(task.c.id)).all() == before


#: The cancel-request and progress revision: the head before rate limits.
CANCEL_AND_PROGRESS = "e4b9c1d6a8f3"


@pytest.mark.usefixtures("clean_database")
def test_upgrading_from_cancel_and_progress_adds_the_rate_limit_table_keeping_every_task(
    url_form: str, form_engine: sa.Engine
) -> None:
    migrate.upgrade(url_form, CANCEL_AND_PROGRESS)
    form_engine.dispose()
    schema_before = _reflect(form_engine)
    assert not sa.inspect(form_engine).has_table(RATE_LIMIT_TABLE)
    task = sa_taskqueue.metadata.tables[TASK_TABLE]
    kept = [task.c[name] for name in (*COLUMNS_0_1, "unique_key", "concurrency_key", "headers", "progress")]
    now = datetime.now(UTC)
    rows = [
        {
            "name": f"tests.{status.value}", "queue": "default", "priority": index, "params": {"n": index},
            "status": status, "run_at": now, "attempts": 1, "max_attempts": 3, "created_at": now,
            "finished_at": now if status in FINISHED_STATUSES else None,
            "locked_by": "host:1:ab" if status is TaskStatus.RUNNING else None,
            "locked_until": now if status is TaskStatus.RUNNING else None,
            "last_error": "ValueError: kaput" if status is TaskStatus.FAILED else None,
            "result": {"ok": True} if status is TaskStatus.COMPLETED else None,
            "unique_key": f"u{index}", "concurrency_key": "k", "headers": {"h": index},
            "progress": 0.5 if status is TaskStatus.RUNNING else None,
        }
        for index, status in enumerate(STATUSES_BEFORE_WORKFLOWS)
    ]  # fmt: skip
    with form_engine.begin() as connection:
        connection.execute(task.insert(), rows)
        before = connection.execute(sa.select(*kept).order_by(task.c.id)).all()
    assert {row.status for row in before} == set(STATUSES_BEFORE_WORKFLOWS)

    migrate.upgrade(url_form)
    form_engine.dispose()
    rates = sa_taskqueue.metadata.tables[RATE_LIMIT_TABLE]
    with form_engine.begin() as connection:
        assert connection.execute(sa.select(*kept).order_by(task.c.id)).all() == before
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()
        connection.execute(
            rates.insert().values(
                id="0" * 64, name="t", rate_window="5/1s", rate_key="t", state="1:1", version=1,
                updated_at=now,
            )
        )  # fmt: skip
        assert connection.execute(sa.select(rates.c.state)).scalar_one() == "1:1"

    migrate.downgrade(url_form, CANCEL_AND_PROGRESS)
    form_engine.dispose()
    assert _reflect(form_engine) == schema_before
    with form_engine.connect() as connection:
        assert connection.execute(sa.select(*kept).order_by(task.c.id)).all() == before


#: The rate-limit revision: the head before workflows.
RATE_LIMITS = "f3a8d2c5b7e1"


@pytest.mark.usefixtures("clean_database")
def test_upgrading_from_rate_limits_adds_the_workflow_columns_and_tables_keeping_every_task(
    url_form: str, form_engine: sa.Engine
) -> None:
    migrate.upgrade(url_form, RATE_LIMITS)
    form_engine.dispose()
    schema_before = _reflect(form_engine)
    assert not sa.inspect(form_engine).has_table(DEPENDENCY_TABLE)
    assert not sa.inspect(form_engine).has_table(BATCH_TABLE)
    task = sa_taskqueue.metadata.tables[TASK_TABLE]
    kept = [
        task.c[name]
        for name in (*COLUMNS_0_1, "unique_key", "concurrency_key", "headers", "progress", "cancelled_by")
    ]
    now = datetime.now(UTC)
    rows = [
        {
            "name": f"tests.{status.value}", "queue": "default", "priority": index, "params": {"n": index},
            "status": status, "run_at": now, "attempts": 1, "max_attempts": 3, "created_at": now,
            "finished_at": now if status in FINISHED_STATUSES else None,
            "locked_by": "host:1:ab" if status is TaskStatus.RUNNING else None,
            "locked_until": now if status is TaskStatus.RUNNING else None,
            "last_error": "ValueError: kaput" if status is TaskStatus.FAILED else None,
            "result": {"ok": True} if status is TaskStatus.COMPLETED else None,
            "unique_key": f"u{index}", "concurrency_key": "k", "headers": {"h": index},
            "progress": 0.5 if status is TaskStatus.RUNNING else None,
            "cancelled_by": "ops" if status is TaskStatus.CANCELLED else None,
        }
        for index, status in enumerate(STATUSES_BEFORE_WORKFLOWS)
    ]  # fmt: skip
    with form_engine.begin() as connection:
        connection.execute(task.insert(), rows)
        before = connection.execute(sa.select(*kept).order_by(task.c.id)).all()
    assert {row.status for row in before} == set(STATUSES_BEFORE_WORKFLOWS)

    migrate.upgrade(url_form)
    form_engine.dispose()
    edges = sa_taskqueue.metadata.tables[DEPENDENCY_TABLE]
    batches = sa_taskqueue.metadata.tables[BATCH_TABLE]
    workflow = (task.c.batch_id, task.c.parents_pending, task.c.on_parent_failure, task.c.has_dependents)
    with form_engine.begin() as connection:
        assert connection.execute(sa.select(*kept).order_by(task.c.id)).all() == before
        assert connection.execute(sa.select(*workflow)).all() == [(None, None, None, None)] * len(before)
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()
        # The new tables take rows: a batch (its counts default to 0) and a
        # waiting task's edge; the new columns take values.
        connection.execute(batches.insert().values(name="nightly", created_at=now))
        batch_id = connection.execute(sa.select(batches.c.id)).scalar_one()
        assert connection.execute(
            sa.select(batches.c.total, batches.c.succeeded, batches.c.failed, batches.c.cancelled)
        ).one() == (0, 0, 0, 0)
        parent_id, child_id = connection.execute(sa.select(task.c.id).order_by(task.c.id).limit(2)).scalars()
        connection.execute(edges.insert().values(parent_id=parent_id, child_id=child_id))
        connection.execute(
            task.update()
            .where(task.c.id == child_id)
            .values(status=TaskStatus.WAITING, parents_pending=1, on_parent_failure="run", batch_id=batch_id)
        )
        connection.execute(task.update().where(task.c.id == parent_id).values(has_dependents=True))
        assert connection.execute(sa.select(*workflow).where(task.c.id == child_id)).one() == (
            batch_id,
            1,
            "run",
            None,
        )
        assert connection.execute(sa.select(task.c.has_dependents).where(task.c.id == parent_id)).scalar_one()

    migrate.downgrade(url_form, RATE_LIMITS)
    form_engine.dispose()
    assert _reflect(form_engine) == schema_before
    with form_engine.connect() as connection:
        after = connection.execute(sa.select(*kept).order_by(task.c.id)).all()
    # Every task kept; the one left waiting is queued again, as nothing would release it.
    waiting = next(index for index, row in enumerate(before) if row.id == child_id)
    assert after[waiting].status == TaskStatus.QUEUED
    assert [row for index, row in enumerate(after) if index != waiting] == [
        row for index, row in enumerate(before) if index != waiting
    ]


def test_the_workflows_revision_compiles_for_oracle(capsys: pytest.CaptureFixture[str]) -> None:
    """Oracle's DDL of the workflows revision, as alembic's offline mode writes it (no server needed)."""
    from alembic import command

    config = migrate.alembic_config("oracle+oracledb://user:secret@localhost/none")
    command.upgrade(config, f"{RATE_LIMITS}:{_head_revision()}", sql=True)
    script = " ".join(capsys.readouterr().out.split())
    for column in ("batch_id NUMBER(19)", "parents_pending INTEGER", "on_parent_failure VARCHAR2(16 CHAR)"):
        assert f"ALTER TABLE sa_taskqueue_task ADD {column}" in script, column
    assert "ALTER TABLE sa_taskqueue_task ADD has_dependents" in script
    assert "CREATE INDEX ix_sa_taskqueue_task_batch ON sa_taskqueue_task (batch_id)" in script
    assert "CREATE TABLE sa_taskqueue_task_dependencies ( parent_id NUMBER(19) NOT NULL" in script
    assert "PRIMARY KEY (parent_id, child_id)" in script
    assert "CREATE TABLE sa_taskqueue_task_batches ( id NUMBER(19) GENERATED BY DEFAULT AS IDENTITY" in script
    assert "total INTEGER DEFAULT 0 NOT NULL" in script
