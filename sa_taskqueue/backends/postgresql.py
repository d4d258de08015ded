"""PostgreSQL: SKIP LOCKED in one statement, advisory locks, LISTEN/NOTIFY, JSONB and TIMESTAMPTZ."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Engine, Table, func
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeEngine

from sa_taskqueue.backends.base import Backend


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

    def json_type(self) -> TypeEngine[Any]:
        # JSONB: compact, and comparable in SQL should a query ever need it.
        return postgresql.JSONB(none_as_null=True)


def _int4(value: int) -> int:
    """The low 32 bits of ``value`` as a signed int4."""
    value &= 0xFFFFFFFF
    return value - 0x1_0000_0000 if value >= 0x8000_0000 else value


__all__ = ["PostgreSQLBackend"]
