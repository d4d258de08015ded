"""What each database is told, asked of its backend: capabilities, connection setup, types.

These compile-level tests need no server, so they run in every session: they
are how the Oracle and MySQL 8 paths are checked where no such server runs.
Each Oracle test runs our own Oracle branch (a type's processing, the claim's
shape, the fetch sizing) through Oracle's dialect.
"""

from __future__ import annotations

import gc
import json
import weakref
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mssql, mysql, oracle, postgresql, sqlite
from sqlalchemy.schema import CreateTable

import sa_taskqueue as tq
from sa_taskqueue.backends import Backend, MySQLBackend, backend_for
from sa_taskqueue.backends.oracle import FETCH_ROWS_OPTION, size_fetch
from sa_taskqueue.core.types import JSONDocument, LongText, UTCDateTime
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.lease import complete_many_statement
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy, claimed_id_params, mark_claimed

TABLE = tq.Task.__table__
NOW = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
REQUEST = ClaimRequest(
    limit=3, queues=("mail",), worker_id="w", now=NOW, lease_until=NOW + timedelta(minutes=5)
)


def mariadb_dialect(url_form: str) -> sa.engine.Dialect:
    return sa.create_engine(f"{url_form}://user@host/db").dialect


# One home per database ---------------------------------------------------------


@pytest.mark.parametrize(
    ("dialect", "backend_name"),
    [
        (postgresql.dialect(), "postgresql"),
        (mysql.dialect(), "mysql"),
        (mariadb_dialect("mariadb+pymysql"), "mariadb"),
        (sqlite.dialect(), "sqlite"),
        (oracle.dialect(), "oracle"),
        (mssql.dialect(), "mssql"),
    ],
)
def test_every_dialect_gets_a_backend_named_for_its_server(
    dialect: sa.engine.Dialect, backend_name: str
) -> None:
    backend = backend_for(dialect)
    assert isinstance(backend, Backend)
    assert backend.name == backend_name
    assert backend_for(dialect) is backend, "one backend per dialect object"


def test_a_backend_lives_no_longer_than_its_dialect() -> None:
    dialect = postgresql.dialect()
    backend_for(dialect)
    gone = weakref.ref(dialect)
    del dialect
    gc.collect()
    assert gone() is None, "an application making engines per tenant must not keep every dialect"


def test_mysql_and_mariadb_urls_get_the_same_backend() -> None:
    under_mysql = mysql.dialect()
    under_mysql.is_mariadb = True  # what SQLAlchemy sets on connecting to MariaDB under mysql://
    for dialect in (under_mysql, mariadb_dialect("mariadb+pymysql")):
        backend = backend_for(dialect)
        assert isinstance(backend, MySQLBackend)
        assert (backend.name, backend.label, backend.skip_locked_since) == ("mariadb", "MariaDB", (10, 6))
    assert backend_for(mysql.dialect()).skip_locked_since == (8, 0, 1)


def test_an_unknown_dialect_gets_the_plain_default() -> None:
    backend = backend_for(mssql.dialect())
    assert type(backend) is Backend
    assert not (backend.skip_locked or backend.advisory_locks or backend.notify or backend.listen)
    assert not backend.direct_execution, "an unknown driver gets SQLAlchemy's full execution path"
    assert SkipLockedStrategy.unsupported_reason(mssql.dialect()) is not None


@pytest.mark.parametrize(
    ("dialect", "capabilities"),
    [
        (postgresql.dialect(), {"skip_locked", "update_from_locked_cte", "notify", "advisory_locks"}),
        (mysql.dialect(), {"skip_locked", "advisory_locks"}),
        (sqlite.dialect(), {"serialised_writes"}),
        (oracle.dialect(), {"skip_locked"}),
    ],
)
def test_capabilities_are_named_per_backend(dialect: sa.engine.Dialect, capabilities: set[str]) -> None:
    backend = backend_for(dialect)
    named = {"skip_locked", "update_from_locked_cte", "notify", "advisory_locks", "serialised_writes"}
    assert {name for name in named if getattr(backend, name)} == capabilities


def test_partial_indexes_where_the_backend_has_them() -> None:
    assert backend_for(postgresql.dialect()).partial_indexes and backend_for(sqlite.dialect()).partial_indexes
    assert not backend_for(mysql.dialect()).partial_indexes, "MySQL and MariaDB index every row"
    claim = next(index for index in TABLE.indexes if index.name.endswith("_claim"))
    cases = ((postgresql.dialect(), True), (sqlite.dialect(), True), (mysql.dialect(), False))
    for dialect, partial in cases:
        created = str(sa.schema.CreateIndex(claim).compile(dialect=dialect))
        assert ("WHERE status = 'queued'" in created) is partial, created


def test_listen_needs_psycopg() -> None:
    assert backend_for(sa.create_engine("postgresql+psycopg://u@h/d").dialect).listen
    # Made without importing the driver: only psycopg 3's notifies() takes a timeout.
    assert not backend_for(postgresql.pg8000.dialect()).listen


def test_skip_locked_depends_on_the_server_version() -> None:
    dialect = mysql.dialect()
    dialect.server_version_info = (8, 0, 0)
    assert not backend_for(dialect).has_skip_locked()
    dialect.server_version_info = (8, 0, 1)
    assert backend_for(dialect).has_skip_locked()


# Types: the model and the migrations ask the backend --------------------------------


@pytest.mark.parametrize(
    ("dialect", "datetime_sql", "json_sql", "long_text_sql"),
    [
        (postgresql.dialect(), "TIMESTAMP WITH TIME ZONE", "JSONB", "TEXT"),
        (mysql.dialect(), "DATETIME(6)", "JSON", "MEDIUMTEXT"),
        (mariadb_dialect("mariadb+pymysql"), "DATETIME(6)", "JSON", "MEDIUMTEXT"),
        (sqlite.dialect(), "DATETIME", "JSON", "TEXT"),
        (oracle.dialect(), "TIMESTAMP", "CLOB", "CLOB"),
    ],
)
def test_column_types_are_the_backends_choice(
    dialect: sa.engine.Dialect, datetime_sql: str, json_sql: str, long_text_sql: str
) -> None:
    created = " ".join(str(CreateTable(TABLE).compile(dialect=dialect)).split())
    assert f"run_at {datetime_sql} NOT NULL" in created
    assert f"params {json_sql} NOT NULL" in created
    assert f"last_error {long_text_sql}" in created


def processors(column_type: sa.types.TypeEngine[object], dialect: sa.engine.Dialect) -> tuple[object, object]:
    impl = column_type.dialect_impl(dialect)
    return impl.bind_processor(dialect), impl.result_processor(dialect, None)


def test_oracle_stores_the_utc_wall_time_and_reads_it_back_as_utc() -> None:
    bind, result = processors(UTCDateTime(), oracle.dialect())
    paris = datetime(2030, 1, 2, 4, 4, 5, 678901, tzinfo=timezone(timedelta(hours=1)))
    stored = bind(paris)  # type: ignore[operator]
    assert stored == NOW.replace(tzinfo=None), "converted to UTC, zone dropped, microseconds kept"
    assert result(stored) == NOW  # type: ignore[operator]
    with pytest.raises(ValueError, match="naive datetime"):
        bind(datetime(2030, 1, 2))  # type: ignore[operator]


def test_postgresql_keeps_the_zone_itself() -> None:
    bind, _ = processors(UTCDateTime(), postgresql.dialect())
    assert bind(NOW).tzinfo is not None  # type: ignore[operator, union-attr]


def test_oracle_json_is_text_serialised_by_the_queue() -> None:
    document = {"to": "a@example.com", "n": [1, 2.5, None]}
    column_type, dialect = JSONDocument(), oracle.dialect()
    stored = column_type.process_bind_param(document, dialect)
    assert isinstance(stored, str) and json.loads(stored) == document
    assert column_type.process_result_value(stored, dialect) == document
    assert column_type.process_bind_param(document, postgresql.dialect()) is document, "native JSON elsewhere"


def test_long_text_is_mediumtext_under_both_mysql_url_forms() -> None:
    for dialect in (mysql.dialect(), mariadb_dialect("mariadb+pymysql")):
        assert LongText().compile(dialect=dialect) == "MEDIUMTEXT"
    assert LongText().compile(dialect=postgresql.dialect()) == "TEXT"


# Oracle's claim ----------------------------------------------------------------------


def test_oracle_marks_the_fetched_ids_claimed_by_id() -> None:
    ids = claimed_id_params(2)
    text = " ".join(str(mark_claimed(TABLE, REQUEST, ids).compile(dialect=oracle.dialect())).split())
    assert "WHERE sa_taskqueue_task.id IN (:claimed_id_0, :claimed_id_1)" in text
    assert "attempts=(sa_taskqueue_task.attempts + :attempts_1)" in text


def test_oracle_fetches_only_the_rows_a_claim_asks_for() -> None:
    # python-oracledb would fetch 100 rows per round trip, and Oracle locks a
    # SKIP LOCKED cursor's rows as they are fetched.
    cursor = SimpleNamespace(prefetchrows=2, arraysize=100)
    context = SimpleNamespace(execution_options={FETCH_ROWS_OPTION: 3})
    size_fetch(None, cursor, "SELECT", {}, context, False)  # type: ignore[arg-type]
    assert (cursor.prefetchrows, cursor.arraysize) == (3, 3)
    untouched = SimpleNamespace(prefetchrows=2, arraysize=100)
    size_fetch(None, untouched, "SELECT", {}, SimpleNamespace(execution_options={}), False)  # type: ignore[arg-type]
    assert (untouched.prefetchrows, untouched.arraysize) == (2, 100), "other statements keep their sizes"


def test_oracle_registers_fetch_sizing_when_a_queue_is_made() -> None:
    engine = sa.create_engine("oracle+oracledb://u:p@h/?service_name=s")
    tq.TaskQueue(engine)
    assert sa.event.contains(engine, "before_cursor_execute", size_fetch)


def test_oracle_completes_many_reading_ids_back_with_returning_into() -> None:
    dialect = oracle.dialect()
    assert backend_for(dialect).update_returning
    text = str(complete_many_statement(TABLE, 2, True, returning=True).compile(dialect=dialect))
    assert "RETURNING sa_taskqueue_task.id INTO" in " ".join(text.split())


def test_oracle_statements_run_as_constructs() -> None:
    # python-oracledb needs SQLAlchemy's input sizes and out-parameters.
    assert not backend_for(oracle.dialect()).direct_execution
    assert backend_for(postgresql.dialect()).direct_execution
