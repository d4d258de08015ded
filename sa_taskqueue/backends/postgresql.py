"""PostgreSQL: SKIP LOCKED in one statement, advisory locks, LISTEN/NOTIFY, JSONB and TIMESTAMPTZ."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, Insert, Table, func
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeEngine

from sa_taskqueue.backends.base import Backend

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

    @property
    def listen(self) -> bool:
        # Waiting for notifications with a timeout needs psycopg 3's notifies().
        return self.dialect.driver == "psycopg"

    @property
    def advisory_locks(self) -> bool:
        return True

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
