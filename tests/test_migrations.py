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
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

import sa_taskqueue
from sa_taskqueue import migrate
from tests.backends import Backend

REPO_ROOT = Path(__file__).resolve().parent.parent
TASK_TABLE = "sa_taskqueue_task"


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


def _alembic(url: str, *args: str) -> None:
    """Run the alembic command line from the repository root, as a developer would."""
    result = subprocess.run(
        [sys.executable, "-m", "alembic", *args],
        cwd=REPO_ROOT,
        env={**os.environ, "SA_TASKQUEUE_DATABASE_URL": url},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, f"alembic {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"


def _head_revision() -> str | None:
    return ScriptDirectory.from_config(migrate.alembic_config("sqlite://")).get_current_head()


def _current_revision(connection: sa.Connection) -> str | None:
    context = MigrationContext.configure(connection, opts={"version_table": migrate.VERSION_TABLE})
    return context.get_current_revision()


def _schema_diff(connection: sa.Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"include_object": migrate.include_object})
    return list(compare_metadata(context, sa_taskqueue.metadata))


def _reflect(engine: sa.Engine) -> dict[str, Any]:
    """The task table as the database reports it, in comparable (repr'd) form."""
    inspector = sa.inspect(engine)
    return {
        "columns": [
            {key: repr(value) for key, value in sorted(column.items())}
            for column in inspector.get_columns(TASK_TABLE)
        ],
        "primary_key": inspector.get_pk_constraint(TASK_TABLE),
        "indexes": sorted(
            (
                {key: repr(value) for key, value in sorted(index.items()) if key != "dialect_options"}
                | {
                    f"dialect_options.{key}": str(value)
                    for key, value in sorted(index.get("dialect_options", {}).items())
                }
                for index in inspector.get_indexes(TASK_TABLE)
            ),
            key=lambda index: index["name"],
        ),
        "unique_constraints": inspector.get_unique_constraints(TASK_TABLE),
        "foreign_keys": inspector.get_foreign_keys(TASK_TABLE),
        "check_constraints": sorted(
            (str(check.get("sqltext")) for check in inspector.get_check_constraints(TASK_TABLE)),
        ),
    }


@pytest.mark.usefixtures("clean_database")
def test_alembic_upgrade_head_matches_metadata_and_downgrade_removes_it(
    backend: Backend, engine: sa.Engine
) -> None:
    had_application_version_table = sa.inspect(engine).has_table("alembic_version")

    _alembic(backend.url, "upgrade", "head")
    engine.dispose()

    with engine.connect() as connection:
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()
    # Our history went to our own version table, not the application's.
    assert sa.inspect(engine).has_table("alembic_version") == had_application_version_table
    migrated = _reflect(engine)

    _alembic(backend.url, "downgrade", "base")
    engine.dispose()
    assert not sa.inspect(engine).has_table(TASK_TABLE)

    # The same table made from the model, reflected the same way.
    sa_taskqueue.metadata.create_all(engine)
    assert migrated == _reflect(engine)


@pytest.mark.usefixtures("clean_database")
def test_migrate_upgrade_creates_the_table(backend: Backend, engine: sa.Engine) -> None:
    migrate.upgrade(backend.url)
    engine.dispose()

    assert sa.inspect(engine).has_table(TASK_TABLE)
    with engine.connect() as connection:
        assert _schema_diff(connection) == []
        assert _current_revision(connection) == _head_revision()

    migrate.downgrade(backend.url)
    engine.dispose()
    assert not sa.inspect(engine).has_table(TASK_TABLE)
