"""PostgreSQL: SKIP LOCKED in one statement, advisory locks, LISTEN/NOTIFY, JSONB and TIMESTAMPTZ."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

from sqlalchemy import URL, ColumnElement, Connection, Engine, Insert, Table, func
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError
from sqlalchemy.types import TypeEngine
from sqlalchemy.util import await_only

from sa_taskqueue.backends.base import Backend, BulkCopier, TableHealthProbe
from sa_taskqueue.backends.table_health.postgresql import measure as measure_table_health

#: SQLSTATE classes worth retrying: connection exception (08), transaction
#: rollback (40: serialization failure, deadlock), insufficient resources
#: (53: too many connections), operator intervention (57: shutdown, restart,
#: statement timeout), system error (58: I/O).
OUTAGE_CLASSES = frozenset({"08", "40", "53", "57", "58"})
#: Single SQLSTATEs worth retrying: lock_not_available (a lock timeout) and
#: read_only_sql_transaction (a standby, during a failover).
OUTAGE_STATES = frozenset({"55P03", "25006"})


class PostgreSQLBackend(Backend):
    label = "PostgreSQL"

    # SKIP LOCKED since 9.5, the oldest server SQLAlchemy 2 supports.
    skip_locked = True
    # A CTE is evaluated once, so its LIMIT holds; UPDATE ... FROM it RETURNING
    # claims in one round trip.
    update_from_locked_cte = True
    # Drivers send BEGIN and COMMIT as round trips of their own, while
    # switching a connection to autocommit is a client-side flag.
    autocommit_statements = True
    direct_execution = True
    notify = True
    partial_indexes = True
    # psycopg splits a multi-row INSERT's thousands of placeholders out with a
    # regular expression on every run; nine arrays cost it nothing.
    insert_from_arrays = True
    # The same for completing a batch: one short statement, planned once.
    completes_from_arrays = True
    # A claim and a completion on two connections run side by side: a worker
    # claiming ahead drained no-op tasks about 30% faster at 1 and 10 slots.
    claims_ahead = True
    # COPY FROM STDIN: no statement to parse, rows streamed in one round trip.
    insert_by_copy = True
    # INSERT ... ON CONFLICT DO NOTHING (9.5+) waits for a clashing insert
    # still in flight, then skips the row without an error.
    insert_skips_conflicts = True
    # psycopg and psycopg2 decode json and jsonb as they fetch a row.
    driver_decodes_json = True
    # PostgreSQL indexes only stored generated columns (18 makes virtual the default).
    indexes_only_stored_generated_columns = True

    driver_extra = "postgresql"
    driver_modules = frozenset({"psycopg", "psycopg_binary"})
    async_driver_modules = frozenset({"asyncpg"})
    # postgresql:// alone means psycopg2, which the extra does not install.
    unnamed_driver = ("psycopg2", "postgresql+psycopg://")
    # asyncpg's connections wait on the futures of the loop that opened them;
    # psycopg's close from any loop.
    loop_bound_drivers = frozenset({"asyncpg"})
    # libpq, Heroku and Render write postgres://; SQLAlchemy 1.4 dropped that name for postgresql://.
    scheme_aliases = frozenset({"postgres"})

    @property
    def listen(self) -> bool:
        # Waiting for notifications with a timeout needs psycopg 3's notifies().
        return self.dialect.driver == "psycopg"

    @property
    def advisory_locks(self) -> bool:
        return True

    def listener_url(self, url: URL) -> URL | None:
        # Any asyncio driver's listener connects through psycopg 3's sync
        # driver, the one that waits for notifications with a timeout.
        if importlib.util.find_spec("psycopg") is None:
            return None
        listening = url.set(drivername="postgresql+psycopg")
        if url.get_driver_name() not in ("psycopg", "psycopg_async"):
            # asyncpg's URL options are not psycopg's: the server and login are kept.
            listening = listening.set(query={})
        return listening

    def bulk_copier(self, conn: Connection) -> BulkCopier | None:
        # COPY FROM STDIN needs psycopg 3 (sync or asyncio); psycopg2 and asyncpg take unnest.
        try:
            import psycopg
        except ImportError:  # pragma: no cover - PostgreSQL drivers without psycopg 3
            return None
        driver = conn.connection.driver_connection
        if not isinstance(driver, psycopg.Connection | psycopg.AsyncConnection):
            return None
        return _PsycopgCopier(conn, driver)

    def table_health_probe(self) -> TableHealthProbe:
        return partial(measure_table_health, label=self.label)

    def advisory_scope(self, engine: Engine, table: Table) -> str:
        # Advisory locks are per database: the table's name is enough.
        return table.name

    def try_advisory_lock(self, namespace: int, key: int) -> ColumnElement[Any]:
        # The two-key form takes two int4s.  Ids 2**32 apart share a lock, which
        # can only make one wait for the other, never let two workers hold one task.
        return func.pg_try_advisory_lock(_int4(namespace), _int4(key))

    def advisory_unlock(self, namespace: int, key: int) -> ColumnElement[Any]:
        return func.pg_advisory_unlock(_int4(namespace), _int4(key))

    def session_id(self) -> ColumnElement[Any]:
        # The server process serving this session: one per session, for its whole life.
        return func.pg_backend_pid()

    @contextmanager
    def bounded_lock_wait(self, conn: Connection, seconds: float) -> Iterator[None]:
        # SET LOCAL ends with the transaction: nothing to put back.
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{max(int(seconds * 1000), 1)}ms'")
        yield

    def lock_wait_ran_out(self, error: BaseException | None) -> bool:
        return _sqlstate(error) == LOCK_NOT_AVAILABLE

    def outage(self, error: BaseException) -> bool | None:
        # psycopg files "program limit exceeded" (54: too many columns) and
        # more under OperationalError; the SQLSTATE class tells them apart.
        # An error with no SQLSTATE never reached the server.
        sqlstate = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
        if not isinstance(sqlstate, str) or not sqlstate:
            return None
        return sqlstate[:2] in OUTAGE_CLASSES or sqlstate in OUTAGE_STATES

    def lost_lock_race(self, error: BaseException) -> bool:
        # deadlock_detected: the server rolled this transaction back to break a cycle.
        return (getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)) == DEADLOCK_DETECTED

    def insert_skipping_conflicts(
        self, into: Table | type[Any], key: ColumnElement[Any], index_where: ColumnElement[bool]
    ) -> Insert:
        # The target names the partial index by its column and predicate.
        return postgresql.insert(into).on_conflict_do_nothing(index_elements=[key], index_where=index_where)

    def json_type(self) -> TypeEngine[Any]:
        # JSONB: compact, and comparable in SQL should a query ever need it.
        return postgresql.JSONB(none_as_null=True)


class _PsycopgCopier:
    """Binary ``COPY ... FROM STDIN`` on a psycopg 3 connection, ids drawn from the id column's sequence.

    COPY returns no ids, so they are drawn first (``nextval`` over
    ``generate_series``, in the query that also reads the column types binary
    COPY needs) and copied in with the rows; an id ``GENERATED BY DEFAULT``
    takes them.  Binary was 15-35% faster than text here.  The COPY goes to
    the driver directly: SQLAlchemy's ``before_cursor_execute`` and
    ``after_cursor_execute`` events do not see it (they do see the
    ``nextval`` query), as SQLAlchemy has no statement for a COPY.
    """

    def __init__(self, conn: Connection, driver: Any) -> None:
        self.conn = conn
        self.driver = driver

    def copy(
        self, table: Table, names: Sequence[str], count: int, values: Callable[[], Sequence[Iterable[Any]]]
    ) -> list[int] | None:
        conn = self.conn
        quote = conn.dialect.identifier_preparer
        target = quote.format_table(table)
        # One round trip for the ids and the columns' types.  The ids: the
        # sequence behind the id column (an identity's too), looked up once and
        # advanced once per row, sent back as one array rather than a row each.
        # The types: binary COPY needs every column's, as the table has it.
        copied = [table.c.id.name, *names]
        drawn, types = conn.exec_driver_sql(
            "SELECT array_agg(nextval(s::regclass)), ("
            "SELECT array_agg(a.atttypid::int ORDER BY k.n) "
            "FROM unnest(%(columns)s::text[]) WITH ORDINALITY AS k(name, n) "
            "JOIN pg_attribute a ON a.attrelid = %(table)s::regclass AND a.attname = k.name) "
            "FROM pg_get_serial_sequence(%(table)s, %(id)s) AS s, generate_series(1, %(count)s)",
            {"table": target, "id": table.c.id.name, "columns": copied, "count": count},
        ).one()
        ids = [int(drawn_id) for drawn_id in drawn or () if drawn_id is not None]
        if len(ids) != count or len(types or ()) != len(copied):  # no sequence behind the id
            return None
        ids.sort()  # so the ids ascend with the rows, as the other paths' do
        listed = ", ".join(quote.format_column(table.c[name]) for name in copied)
        self._copy(
            f"COPY {target} ({listed}) FROM STDIN (FORMAT BINARY)",
            types,
            zip(ids, *values(), strict=True),
        )
        return ids

    def _copy(self, sql: str, types: list[int], rows: Iterable[tuple[Any, ...]]) -> None:
        """Binary ``COPY ... FROM STDIN`` of ``rows`` (of these type oids) on the driver connection."""
        import psycopg

        conn, driver = self.conn, self.driver
        try:
            if isinstance(driver, psycopg.AsyncConnection):
                # An AsyncSession runs this code in SQLAlchemy's greenlet, which can
                # wait on the connection's event loop as its own driver calls do.
                await_only(_copy_async(driver, sql, types, rows))
                return
            with driver.cursor() as cursor, cursor.copy(sql) as copy:
                copy.set_types(types)
                for row in rows:
                    copy.write_row(row)
        except psycopg.Error as error:
            # As SQLAlchemy wraps a driver's error (an IntegrityError stays one),
            # so callers catch the same exceptions whichever path the rows took;
            # and as it does, a lost connection is invalidated and said to be.
            lost = conn.dialect.is_disconnect(error, conn.connection.dbapi_connection, None)  # type: ignore[arg-type]
            if lost:
                conn.invalidate(error)
            raise DBAPIError.instance(sql, None, error, psycopg.Error, connection_invalidated=lost) from error


async def _copy_async(driver: Any, sql: str, types: list[int], rows: Iterable[tuple[Any, ...]]) -> None:
    async with driver.cursor() as cursor, cursor.copy(sql) as copy:
        copy.set_types(types)
        for row in rows:
            await copy.write_row(row)


#: SQLSTATE of a transaction rolled back to end a deadlock.
DEADLOCK_DETECTED = "40P01"
#: SQLSTATE of a lock wait ended by lock_timeout.
LOCK_NOT_AVAILABLE = "55P03"


def _sqlstate(error: BaseException | None) -> str | None:
    found = getattr(error, "sqlstate", None) or getattr(error, "pgcode", None)
    return found if isinstance(found, str) else None


def _int4(value: int) -> int:
    """The low 32 bits of ``value`` as a signed int4."""
    value &= 0xFFFFFFFF
    return value - 0x1_0000_0000 if value >= 0x8000_0000 else value


__all__ = ["OUTAGE_CLASSES", "OUTAGE_STATES", "PostgreSQLBackend"]
