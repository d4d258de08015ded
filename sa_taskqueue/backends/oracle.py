"""Oracle: SKIP LOCKED from an unbounded cursor, fetch sizing, TIMESTAMP in UTC, JSON as CLOB text."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, event, func
from sqlalchemy.dialects import oracle
from sqlalchemy.types import TypeEngine

from sa_taskqueue.backends.base import FETCH_ROWS_OPTION, Backend


class OracleBackend(Backend):
    label = "Oracle"

    skip_locked = True
    # ORA-02014: FETCH FIRST, and the ROWNUM wrapper SQLAlchemy renders for a
    # limit, cannot stand beside FOR UPDATE; ROWNUM would also be applied
    # before SKIP LOCKED, returning nothing when the first rows are locked.
    limit_with_for_update = False
    # No direct execution: python-oracledb needs the input sizes SQLAlchemy
    # sets (or it binds a datetime as a DATE, dropping the microseconds the
    # claim guards compare) and out-parameters for RETURNING.
    explain_prefix = "EXPLAIN PLAN FOR "
    # python-oracledb binds an aware datetime as a plain TIMESTAMP that the
    # server shifts by the session time zone: the UTC wall time is stored.
    stores_naive_utc = True
    # Oracle before 21c has no JSON type, and SQLAlchemy's support for it varies.
    json_as_text = True
    # No ON CONFLICT: a duplicate key (ORA-00001) is caught inside a SAVEPOINT.
    # (Statement-level read consistency: a plain SELECT sees the clashing row.)
    insert_skips_conflicts = False

    driver_extra = "oracle"
    driver_modules = frozenset({"oracledb"})
    # oracle:// alone means cx_Oracle, which the extra does not install.
    unnamed_driver = ("cx_Oracle", "oracle+oracledb://")

    def configure_engine(self, engine: Engine) -> None:
        if not event.contains(engine, "before_cursor_execute", size_fetch):
            event.listen(engine, "before_cursor_execute", size_fetch)

    def session_id(self) -> ColumnElement[Any]:
        return func.sys_context("USERENV", "SID")

    @contextmanager
    def bounded_lock_wait(self, conn: Connection, seconds: float) -> Iterator[None]:
        # Oracle has no lock timeout a SELECT ... FOR UPDATE SKIP LOCKED can
        # take (WAIT n cannot stand beside SKIP LOCKED): python-oracledb's
        # call timeout ends the call instead (DPI-1067).
        driver: Any = conn.connection.driver_connection
        before = driver.call_timeout
        driver.call_timeout = max(int(seconds * 1000), 1)
        try:
            yield
        finally:
            driver.call_timeout = before

    def lock_wait_ran_out(self, error: BaseException | None) -> bool:
        return "DPI-1067" in str(error)

    def duplicate_key(self, error: BaseException | None, index: str) -> bool:
        # ORA-00001: "unique constraint (<schema>.<INDEX>) violated"; the
        # statement alone is undone, the transaction goes on.
        return "ORA-00001" in str(error) and super().duplicate_key(error, index)

    def lost_lock_race(self, error: BaseException) -> bool:
        # ORA-00060: "deadlock detected while waiting for resource"; Oracle
        # undoes the statement, and the claim rolls its transaction back.
        return "ORA-00060" in str(error)

    def datetime_type(self) -> TypeEngine[Any]:
        # DateTime(timezone=True) becomes DATE here: whole seconds.
        return oracle.TIMESTAMP()

    def json_type(self) -> TypeEngine[Any]:
        return oracle.CLOB()


def size_fetch(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> None:
    """Fetch only the rows a statement asks for, where it sets `FETCH_ROWS_OPTION`.

    python-oracledb prefetches 2 rows and then fetches 100 per round trip by
    default, and Oracle locks a SKIP LOCKED cursor's rows as they are
    fetched: a claim of 1 would lock up to 100 rows until it commits.
    """
    rows = context.execution_options.get(FETCH_ROWS_OPTION) if context is not None else None
    if rows:
        cursor.prefetchrows = rows
        cursor.arraysize = rows


__all__ = ["FETCH_ROWS_OPTION", "OracleBackend", "size_fetch"]
