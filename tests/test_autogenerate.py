"""``alembic revision --autogenerate`` on an application's own Base, as an application runs it.

Each test writes a small Alembic project into a temporary directory (an
``alembic.ini``, an ``env.py`` that sets ``target_metadata`` and passes
``render_item=sa_taskqueue.integrations.alembic.render_item``, and a models module mapping
`TaskMixin` on the application's own Base beside a table of its own), then
runs the real ``alembic`` command line against the suite's database: the
first autogenerate writes a revision, ``upgrade head`` applies it, a queue
claims from the table it made, a second autogenerate must find nothing to
change, and ``downgrade base`` removes it all.

An ``env.py`` that sets nothing but ``target_metadata`` sees every table in
the database, so these tests run on a database of their own on the same
server, empty when each test starts and dropped when it ends.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.script import ScriptDirectory
from sqlalchemy.dialects import mysql, oracle, postgresql
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core import migrate
from sa_taskqueue.integrations.alembic import OUR_TYPES, include_object, physical_type_source, render_item
from tests.backends import Backend

ROOT = Path(__file__).resolve().parent.parent

#: Every table these tests make starts with this, so a run that was cut
#: short leaves nothing the next one cannot find and drop.
PREFIX = "autogen_"

#: The application's version table: Alembic's default name, which the
#: library's own history (``sa_taskqueue_alembic_version``) must not share.
APP_VERSION_TABLE = "alembic_version"

HOOK = "render_item=sa_taskqueue.integrations.alembic.render_item"
FILTER = "include_object=sa_taskqueue.integrations.alembic.include_object"

MODELS = '''\
"""The application's models: its own Base, a task table on it, and a table of its own."""

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sa_taskqueue import TaskMixin
class Base(DeclarativeBase):
    pass


class Job(TaskMixin, Base):
    __tablename__ = "{jobs}"


class Customer(Base):
    __tablename__ = "{customers}"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(200), unique=True)
'''

ENV = '''\
"""The application's Alembic environment: its metadata, and nothing else of its own."""

from alembic import context
from sqlalchemy import engine_from_config, pool

import sa_taskqueue.integrations.alembic
from models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = engine_from_config(
        config.get_section(config.config_ini_section, {{}}), prefix="sqlalchemy.", poolclass=pool.NullPool
    )
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata{options})
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
'''

SCRIPT_TEMPLATE = '''\
"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""
from alembic import op
import sqlalchemy as sa
${imports if imports else ""}

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    ${downgrades if downgrades else "pass"}
'''


@dataclass
class Project:
    """An application's Alembic project in a directory, pointed at one database."""

    directory: Path
    url: str
    jobs: str
    customers: str

    def write(self, *options: str) -> None:
        """Write the project, its ``env.py`` passing `options` to ``context.configure``."""
        versions = self.directory / "migrations" / "versions"
        versions.mkdir(parents=True, exist_ok=True)
        (self.directory / "alembic.ini").write_text(
            "[alembic]\n"
            "script_location = %(here)s/migrations\n"
            "prepend_sys_path = %(here)s\n"
            "path_separator = os\n"
            # ConfigParser would read a "%" in the URL as interpolation.
            f"sqlalchemy.url = {self.url.replace('%', '%%')}\n"
        )
        (self.directory / "models.py").write_text(MODELS.format(jobs=self.jobs, customers=self.customers))
        rendered_options = "".join(f", {option}" for option in options)
        (self.directory / "migrations" / "env.py").write_text(ENV.format(options=rendered_options))
        (self.directory / "migrations" / "script.py.mako").write_text(SCRIPT_TEMPLATE)

    def alembic(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """The alembic command line, run in the project's directory."""
        result = subprocess.run(
            [sys.executable, "-m", "alembic", *args],
            cwd=self.directory,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if check:
            assert result.returncode == 0, (
                f"alembic {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
            )
        return result

    def autogenerate(self, message: str) -> Path:
        """Run ``alembic revision --autogenerate`` and return the revision it wrote."""
        before = set(self.versions())
        self.alembic("revision", "--autogenerate", "-m", message)
        (written,) = set(self.versions()) - before
        return written

    def versions(self) -> list[Path]:
        return sorted((self.directory / "migrations" / "versions").glob("*.py"))

    def models(self) -> ModuleType:
        """The project's models module, loaded under a name of its own."""
        spec = importlib.util.spec_from_file_location(f"{self.jobs}_models", self.directory / "models.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def _our_tables(engine: sa.Engine) -> list[str]:
    return [name for name in sa.inspect(engine).get_table_names() if name.startswith(PREFIX)]


def _drop(engine: sa.Engine, *names: str) -> None:
    with engine.begin() as connection:
        for name in names:
            sa.Table(name, sa.MetaData()).drop(connection, checkfirst=True)


@dataclass(frozen=True)
class Scratch:
    """A database of the backend's server holding no tables, made for one test and dropped after it."""

    url: str
    engine: sa.Engine


@pytest.fixture
def scratch(backend: Backend, tmp_path: Path) -> Iterator[Scratch]:
    """An empty database beside the suite's: an ``env.py`` that sets only ``target_metadata`` sees
    every table of its database, so these tests must not share one with the rest of the suite."""
    url = sa.make_url(backend.url)
    if backend.is_sqlite:
        scratch_url = url.set(database=str(tmp_path / "scratch.db"))
        engine = sa.create_engine(scratch_url, poolclass=sa.pool.NullPool)
        yield Scratch(scratch_url.render_as_string(hide_password=False), engine)
        engine.dispose()
        return
    # One per test database, so sessions running side by side on one server never share it.
    name = f"{url.database}_autogen"
    admin = sa.create_engine(
        url.set(database="postgres" if backend.is_postgres else url.database),
        isolation_level="AUTOCOMMIT",
        poolclass=sa.pool.NullPool,
    )
    quoted = admin.dialect.identifier_preparer.quote(name)
    # PostgreSQL refuses to drop a database someone is connected to; FORCE ends those sessions.
    force = " WITH (FORCE)" if backend.is_postgres else ""
    with admin.connect() as connection:
        connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {quoted}{force}")
        connection.exec_driver_sql(f"CREATE DATABASE {quoted}")
    scratch_url = url.set(database=name)
    engine = sa.create_engine(scratch_url, poolclass=sa.pool.NullPool)
    try:
        yield Scratch(scratch_url.render_as_string(hide_password=False), engine)
    finally:
        engine.dispose()
        with admin.connect() as connection:
            connection.exec_driver_sql(f"DROP DATABASE IF EXISTS {quoted}{force}")
        admin.dispose()


@pytest.fixture
def project(tmp_path: Path, scratch: Scratch) -> Project:
    suffix = uuid.uuid4().hex[:8]
    return Project(tmp_path / "app", scratch.url, f"{PREFIX}jobs_{suffix}", f"{PREFIX}customers_{suffix}")


def _function_bodies(source: str) -> dict[str, list[str]]:
    """What ``upgrade`` and ``downgrade`` of a revision do, one statement each (comments dropped)."""
    tree = ast.parse(source)
    return {
        node.name: [ast.unparse(statement) for statement in node.body]
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in ("upgrade", "downgrade")
    }


def _assert_no_operations(revision: Path) -> None:
    """The revision does nothing either way; it is then removed, as a developer would."""
    source = revision.read_text()
    bodies = _function_bodies(source)
    assert bodies == {"upgrade": ["pass"], "downgrade": ["pass"]}, f"drift was found:\n{source}"
    revision.unlink()


def _shape(engine: sa.Engine, table: str) -> dict[str, Any]:
    """A table as the database reports it, with the table's name taken out of its index names."""
    inspector = sa.inspect(engine)
    return {
        "columns": [
            {key: repr(value) for key, value in sorted(column.items())}
            for column in inspector.get_columns(table)
        ],
        "primary_key": inspector.get_pk_constraint(table)["constrained_columns"],
        "indexes": sorted(
            (
                {
                    "name": str(index["name"]).replace(table, "<table>"),
                    "columns": index["column_names"],
                    "unique": bool(index["unique"]),
                    # The partial index predicate (postgresql_where, sqlite_where) where reflected.
                    **{key: str(value) for key, value in index.get("dialect_options", {}).items()},
                }
                for index in inspector.get_indexes(table)
            ),
            key=lambda index: index["name"],
        ),
    }


def test_render_item_writes_each_of_our_types_as_the_physical_type_every_database_gets() -> None:
    context = SimpleNamespace(imports=set(), opts={"sqlalchemy_module_prefix": "sa."})
    namespace = {"sa": sa, "mysql": mysql, "oracle": oracle, "postgresql": postgresql}
    for our_type in OUR_TYPES:
        source = render_item("type", our_type(), context)
        assert isinstance(source, str)
        assert "sa_taskqueue" not in source
        written = eval(source, namespace)  # the revision's own expression, as the revision runs it
        for name in ("postgresql", "mysql", "mariadb", "sqlite", "oracle", "mssql"):
            dialect = sa.engine.URL.create(name).get_dialect()()
            assert str(written.compile(dialect=dialect)) == str(our_type().compile(dialect=dialect)), name
    assert context.imports == {
        f"from sqlalchemy.dialects import {name}" for name in ("mysql", "oracle", "postgresql")
    }


def test_render_item_leaves_everything_else_to_alembic() -> None:
    context = SimpleNamespace(imports=set(), opts={"sqlalchemy_module_prefix": "sa."})
    assert render_item("type", sa.Integer(), context) is False
    assert render_item("type", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), context) is False
    assert render_item("server_default", tq.types.UTCDateTime(), context) is False
    assert context.imports == set()


def test_a_datetime_column_is_written_with_a_variant_per_database_type() -> None:
    context = SimpleNamespace(imports=set(), opts={"sqlalchemy_module_prefix": "sa."})
    assert physical_type_source(tq.types.UTCDateTime(), context) == (
        "sa.DateTime(timezone=True)"
        ".with_variant(mysql.DATETIME(fsp=6), 'mariadb', 'mysql')"
        ".with_variant(oracle.TIMESTAMP(), 'oracle')"
    )


@pytest.mark.backends("sqlite", "postgres", "postgres18", "mysql", "mariadb")
def test_autogenerate_upgrade_claim_no_drift_then_downgrade(
    project: Project, scratch: Scratch, backend: Backend
) -> None:
    engine = scratch.engine
    project.write(HOOK)

    first = project.autogenerate("jobs and customers").read_text()
    assert "sa_taskqueue" not in first, "the revision must run without the library"
    operations = _function_bodies(first)["upgrade"]
    created = [op for op in operations if op.startswith("op.create_table(")]
    assert sorted(op.split("'")[1] for op in created) == sorted(
        [
            project.jobs,
            f"{project.jobs}_control",
            f"{project.jobs}_workers",
            f"{project.jobs}_rate_limits",
            f"{project.jobs}_dependencies",
            f"{project.jobs}_batches",
            project.customers,
        ]
    )
    # The mixin's two indexes, each kept to one status where partial indexes exist.
    claim_index = next(op for op in operations if f"'ix_{project.jobs}_claim'" in op)
    lease_index = next(op for op in operations if f"'ix_{project.jobs}_lease'" in op)
    assert "['status', 'priority', 'run_at', 'id']" in claim_index
    assert "['status', 'locked_until']" in lease_index
    for index, status in ((claim_index, "queued"), (lease_index, "running")):
        for dialect in ("postgresql", "sqlite"):
            assert f"{dialect}_where=sa.text(\"status = '{status}'\")" in index, index

    project.alembic("upgrade", "head")
    engine.dispose()
    assert set(_our_tables(engine)) == {
        project.jobs,
        f"{project.jobs}_control",
        f"{project.jobs}_workers",
        f"{project.jobs}_rate_limits",
        f"{project.jobs}_dependencies",
        f"{project.jobs}_batches",
        project.customers,
    }

    # The migrated table is the one create_all makes from the same model,
    # column by column and index by index (partial predicates, DATETIME(6),
    # MEDIUMTEXT and the identity included, which autogenerate cannot see).
    models = project.models()
    migrated = _shape(engine, project.jobs)
    if backend.is_postgres or backend.is_sqlite:
        # The partial indexes hold one status each, as the database reports them.
        predicates = {
            index["name"]: index.get("postgresql_where") or index.get("sqlite_where")
            for index in migrated["indexes"]
        }
        assert "'queued'" in str(predicates["ix_<table>_claim"])
        assert "'running'" in str(predicates["ix_<table>_lease"])
    reference = sa.MetaData()
    models.Job.__table__.to_metadata(reference, name=f"{project.jobs}_ref")
    # The reference's indexes carry the migrated table's names; rename them after the copy.
    for index in reference.tables[f"{project.jobs}_ref"].indexes:
        index.name = str(index.name).replace(project.jobs, f"{project.jobs}_ref")
    reference.create_all(engine)
    try:
        assert migrated == _shape(engine, f"{project.jobs}_ref")
    finally:
        reference.drop_all(engine)

    # A queue works on the table the revision made.
    queue = tq.TaskQueue(engine, model=models.Job)
    try:

        @queue.task(name="welcome")
        def welcome(customer_id: int) -> None:  # pragma: no cover - claimed, never run
            del customer_id

        with Session(engine) as session, session.begin():
            session.add(models.Customer(email="ada@example.com"))
            welcome.enqueue(session, customer_id=1)
        (claimed,) = queue.claim(limit=5)
        assert (claimed.name, claimed.params, claimed.attempts) == ("welcome", {"customer_id": 1}, 1)
        assert queue.complete(claimed, {"sent": True})
    finally:
        queue.close()

    # Nothing to change: the database compares its own types with ours as equal.
    _assert_no_operations(project.autogenerate("nothing"))

    project.alembic("downgrade", "base")
    engine.dispose()
    assert _our_tables(engine) == []
    with engine.connect() as connection:
        assert connection.scalar(sa.text(f"SELECT COUNT(*) FROM {APP_VERSION_TABLE}")) == 0


#: What `TaskMixin` added after 0.1: columns (in the model's order), indexes, and the control and
#: worker tables.
ADDED_COLUMNS = (
    "unique_key", "concurrency_key", "concurrency_slot", "active_unique_key", "running_slot_key", "headers",
    "cancel_requested_at", "cancelled_by", "progress", "progress_note", "progress_at",
    "batch_id", "parents_pending", "on_parent_failure", "has_dependents",
)  # fmt: skip
ADDED_INDEXES = ("ix_{table}_finished", "ux_{table}_unique", "ux_{table}_slot", "ix_{table}_batch")


def _make_0_1_table(engine: sa.Engine, table: sa.Table) -> None:
    """``table`` as `TaskMixin` declared it in 0.1: today's, less what came after."""
    old = sa.MetaData()
    copy = table.to_metadata(old)
    for index in list(copy.indexes):
        if index.name in {name.format(table=table.name) for name in ADDED_INDEXES}:
            copy.indexes.discard(index)
    for name in ADDED_COLUMNS:
        copy._columns.remove(copy.c[name])
    old.create_all(engine, tables=[copy])


@pytest.mark.backends("sqlite", "postgres", "postgres18", "mysql", "mariadb")
def test_autogenerate_brings_a_0_1_table_to_the_current_mixin_without_losing_tasks(
    project: Project, scratch: Scratch, backend: Backend
) -> None:
    engine = scratch.engine
    project.write(HOOK)
    models = project.models()
    _make_0_1_table(engine, models.Job.__table__)
    models.Base.metadata.create_all(engine, tables=[models.Customer.__table__])
    now = datetime.now(UTC)
    with engine.begin() as connection:
        connection.execute(
            sa.text(
                f"INSERT INTO {project.jobs} (name, queue, priority, params, status, run_at, attempts,"
                " max_attempts, created_at) VALUES ('welcome', 'default', 0, '{}', :status, :now, 0, 3, :now)"
            ).bindparams(sa.bindparam("now", type_=tq.types.UTCDateTime())),
            [{"status": status.value, "now": now} for status in tq.TaskStatus],
        )

    revision = project.autogenerate("scheduling controls").read_text()
    operations = _function_bodies(revision)["upgrade"]
    for column in ADDED_COLUMNS:
        assert any(op.startswith("op.add_column(") and f"'{column}'" in op for op in operations), column
    for index in ADDED_INDEXES:
        assert any(f"'{index.format(table=project.jobs)}'" in op for op in operations), index
    for table in (
        f"{project.jobs}_control",
        f"{project.jobs}_workers",
        f"{project.jobs}_rate_limits",
        f"{project.jobs}_dependencies",
        f"{project.jobs}_batches",
    ):
        assert any(op.startswith("op.create_table(") and f"'{table}'" in op for op in operations), table
    if backend.is_postgres:
        # Only a stored generated column can be indexed there.
        assert revision.count("persisted=True") == 2

    project.alembic("upgrade", "head")
    engine.dispose()
    with engine.connect() as connection:
        statuses = connection.scalars(sa.text(f"SELECT status FROM {project.jobs} ORDER BY id")).all()
    assert statuses == [status.value for status in tq.TaskStatus]
    _assert_no_operations(project.autogenerate("nothing"))
    # And the keys work: a second queued task with one name and key is refused by the index.
    with engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE {project.jobs} SET unique_key = 'k' WHERE status = 'queued'"))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as connection:
        connection.execute(sa.text(f"UPDATE {project.jobs} SET unique_key = 'k' WHERE status = 'running'"))


@pytest.mark.backends("sqlite", "postgres", "postgres18", "mysql", "mariadb")
def test_without_the_hook_the_revision_cannot_run(
    project: Project, scratch: Scratch, backend: Backend
) -> None:
    engine = scratch.engine
    project.write()

    first = project.autogenerate("jobs and customers").read_text()
    assert "sa_taskqueue.core.types.UTCDateTime(timezone=True)" in first
    assert "import sa_taskqueue" not in first

    failed = project.alembic("upgrade", "head", check=False)
    assert failed.returncode != 0
    assert "NameError: name 'sa_taskqueue' is not defined" in failed.stderr
    engine.dispose()
    made = _our_tables(engine)
    assert project.jobs not in made
    if backend.is_postgres:
        # Transactional DDL: the failed revision left nothing behind.
        assert made == []
    else:
        # MySQL, MariaDB and SQLite (as pysqlite runs DDL) keep what ran before
        # the failing line: the tables the revision creates first.
        assert set(made) <= {project.customers}
    with engine.connect() as connection:
        assert not sa.inspect(connection).has_table(APP_VERSION_TABLE) or (
            connection.scalar(sa.text(f"SELECT COUNT(*) FROM {APP_VERSION_TABLE}")) == 0
        )


@pytest.mark.backends("sqlite", "postgres", "postgres18", "mysql", "mariadb")
def test_the_librarys_migrations_and_the_applications_share_one_database(
    project: Project, scratch: Scratch, backend: Backend
) -> None:
    engine, url = scratch.engine, scratch.url
    migrate.upgrade(url)
    library_head = migrate.alembic_config(url)

    # Without the filter, the application's autogenerate would drop our table and our history.
    project.write(HOOK)
    unfiltered_revision = project.autogenerate("unfiltered")
    unfiltered = _function_bodies(unfiltered_revision.read_text())["upgrade"]
    assert "op.drop_table('sa_taskqueue_task')" in unfiltered
    assert f"op.drop_table('{migrate.VERSION_TABLE}')" in unfiltered
    unfiltered_revision.unlink()

    project.write(HOOK, FILTER)
    first_revision = project.autogenerate("jobs and customers")
    first = _function_bodies(first_revision.read_text())["upgrade"]
    assert not [op for op in first if "sa_taskqueue" in op]
    project.alembic("upgrade", "head")
    _assert_no_operations(project.autogenerate("nothing"))

    engine.dispose()
    inspector = sa.inspect(engine)
    assert {APP_VERSION_TABLE, migrate.VERSION_TABLE, "sa_taskqueue_task"} <= set(inspector.get_table_names())
    with engine.connect() as connection:
        application = connection.scalar(sa.text(f"SELECT version_num FROM {APP_VERSION_TABLE}"))
        library = connection.scalar(sa.text(f"SELECT version_num FROM {migrate.VERSION_TABLE}"))
    assert application == first_revision.name.split("_")[0]
    assert library == ScriptDirectory.from_config(library_head).get_current_head()

    # Each history goes down alone.
    project.alembic("downgrade", "base")
    engine.dispose()
    assert _our_tables(engine) == []
    assert sa.inspect(engine).has_table("sa_taskqueue_task")
    migrate.downgrade(url)
    engine.dispose()
    assert not sa.inspect(engine).has_table("sa_taskqueue_task")


def test_include_object_skips_only_the_librarys_tables_found_in_the_database() -> None:
    table = sa.Table("sa_taskqueue_task", sa.MetaData())
    assert include_object(table, "sa_taskqueue_task", "table", True, None) is False
    assert include_object(table, migrate.VERSION_TABLE, "table", True, None) is False
    # An application that declares a table of that name manages it itself.
    assert include_object(table, "sa_taskqueue_task", "table", True, table) is True
    assert include_object(table, "sa_taskqueue_task", "table", False, None) is True
    assert include_object(table, "customers", "table", True, None) is True
    assert include_object(sa.Column("id"), "id", "column", True, None) is True
