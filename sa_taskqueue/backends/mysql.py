"""MySQL and MariaDB: SKIP LOCKED from 8.0.1 / 10.6, READ COMMITTED claims, GET_LOCK, DATETIME(6), MEDIUMTEXT.

SQLAlchemy names the dialect ``"mysql"`` under a ``mysql://`` URL (setting
``is_mariadb`` when the server is MariaDB) and ``"mariadb"`` under a
``mariadb://`` URL.  Both names land here and get the same treatment.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, Table, func
from sqlalchemy.dialects import mysql
from sqlalchemy.types import TypeEngine

from sa_taskqueue.backends.base import Backend

#: The first versions with SKIP LOCKED.
MYSQL_SKIP_LOCKED_SINCE = (8, 0, 1)
MARIADB_SKIP_LOCKED_SINCE = (10, 6)


class MySQLBackend(Backend):
    skip_locked = True
    # MySQL and MariaDB UPDATE by primary key takes no gap locks, and a
    # transaction of their own costs no extra round trip (switching
    # autocommit does), so single statements run in plain transactions.
    autocommit_statements = False
    direct_execution = True
    # DATETIME keeps no zone.
    stores_naive_utc = True

    @property
    def is_mariadb(self) -> bool:
        """MariaDB, whichever name SQLAlchemy gave the dialect."""
        return self.dialect.name == "mariadb" or bool(getattr(self.dialect, "is_mariadb", False))

    @property
    def name(self) -> str:
        return "mariadb" if self.is_mariadb else "mysql"

    @property
    def label(self) -> str:  # type: ignore[override]
        return "MariaDB" if self.is_mariadb else "MySQL"

    @property
    def skip_locked_since(self) -> tuple[int, ...]:  # type: ignore[override]
        return MARIADB_SKIP_LOCKED_SINCE if self.is_mariadb else MYSQL_SKIP_LOCKED_SINCE

    def begin_locking_reads(self, conn: Connection) -> None:
        # Under the default REPEATABLE READ a locking read also takes gap
        # locks on the index range it walked, which block enqueues into that
        # range and deadlock concurrent claimers; READ COMMITTED locks only
        # the rows it returns.  SET TRANSACTION (no SESSION) applies to this
        # transaction alone: nothing to reset afterwards.
        conn.exec_driver_sql("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")

    @property
    def advisory_locks(self) -> bool:
        return True

    def advisory_scope(self, engine: Engine, table: Table) -> str:
        # Named locks are server-wide, so the database is part of the name.
        return f"{engine.url.database}.{table.schema}.{table.name}"

    def try_advisory_lock(self, namespace: int, key: int) -> ColumnElement[Any]:
        # Lock names are at most 64 characters.
        return func.get_lock(_lock_name(namespace, key), 0)

    def advisory_unlock(self, namespace: int, key: int) -> ColumnElement[Any]:
        return func.release_lock(_lock_name(namespace, key))

    def datetime_type(self) -> TypeEngine[Any]:
        # DATETIME has whole seconds unless asked for fsp=6.
        return mysql.DATETIME(fsp=6)

    def long_text_type(self) -> TypeEngine[Any]:
        # TEXT stops at 64 KiB; a traceback can be longer.
        return mysql.MEDIUMTEXT()


def _lock_name(namespace: int, key: int) -> str:
    return f"sa_taskqueue:{namespace & 0xFFFFFFFF:08x}:{key}"


__all__ = ["MARIADB_SKIP_LOCKED_SINCE", "MYSQL_SKIP_LOCKED_SINCE", "MySQLBackend"]
