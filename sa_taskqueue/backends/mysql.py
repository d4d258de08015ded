"""MySQL and MariaDB: SKIP LOCKED from 8.0.1 / 10.6, READ COMMITTED claims, GET_LOCK, DATETIME(6), MEDIUMTEXT.

SQLAlchemy names the dialect ``"mysql"`` under a ``mysql://`` URL (setting
``is_mariadb`` when the server is MariaDB) and ``"mariadb"`` under a
``mariadb://`` URL.  Both names land here and get the same treatment.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from sqlalchemy import ColumnElement, Connection, Delete, Engine, Table, event, func
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeEngine

from sa_taskqueue.backends.base import Backend, TableHealthProbe
from sa_taskqueue.backends.table_health.mysql import measure as measure_table_health

#: The first versions with SKIP LOCKED.
MYSQL_SKIP_LOCKED_SINCE = (8, 0, 1)
MARIADB_SKIP_LOCKED_SINCE = (10, 6)

#: The client library's own errors (2000-2999): cannot connect, server gone
#: away, lost connection during a query, ...
CLIENT_ERRORS = (2000, 2999)
#: Server errors worth retrying: a write conflict (MariaDB 1020, "record has
#: changed since last read"), too many connections (1040), shutdown in
#: progress (1053), aborted or broken connections (1152, 1158-1161), lock
#: wait timeout (1205), deadlock (1213), a server read-only during a failover
#: (1290, 1792, 1836), query interrupted (1317), statement time limit (MariaDB
#: 1969, MySQL 3024), connection killed (MariaDB 1927), disconnected for
#: inactivity (MySQL 4031).
OUTAGE_ERRORS = frozenset(
    {1020, 1040, 1053, 1152, 1158, 1159, 1160, 1161, 1205, 1213, 1290, 1317, 1792, 1836, 1927, 1969}
    | {3024, 4031}
)

#: ER_DUP_ENTRY: a row clashes with a unique index.
DUPLICATE_ENTRY = 1062


class MySQLBackend(Backend):
    skip_locked = True
    # MySQL and MariaDB UPDATE by primary key takes no gap locks, and a
    # transaction of their own costs no extra round trip (switching
    # autocommit does), so single statements run in plain transactions.
    autocommit_statements = False
    direct_execution = True
    # DATETIME keeps no zone.
    stores_naive_utc = True
    # Error 1235: "doesn't yet support 'LIMIT & IN/ALL/ANY/SOME subquery'";
    # DELETE itself takes a LIMIT instead.
    delete_with_limit = True
    # No ON CONFLICT; INSERT IGNORE would turn every other error of the row
    # into a warning, so a duplicate key is caught inside a SAVEPOINT instead.
    insert_skips_conflicts = False
    # InnoDB's default REPEATABLE READ reads from the transaction's first
    # snapshot: the task a duplicate key points at may have committed after it.
    snapshot_reads = True

    driver_extra = "mysql"
    driver_modules = frozenset({"pymysql"})
    async_driver_modules = frozenset({"aiomysql", "asyncmy"})
    # mysql:// alone means mysqlclient (MySQLdb), which the extra does not install.
    unnamed_driver = ("MySQLdb", "mysql+pymysql://")
    # Both asyncio drivers' connections wait on futures of the loop that opened them.
    loop_bound_drivers = frozenset({"aiomysql", "asyncmy"})

    def __init__(self, dialect: Dialect) -> None:
        super().__init__(dialect)
        #: Whether the server is a Galera node: None until a connection has asked it.
        self._galera: bool | None = None

    @property
    def galera(self) -> bool:
        # Known once a connection has asked (`configure_engine`'s first
        # connect, or `prepare_database`): False until then.
        return bool(self._galera)

    def configure_engine(self, engine: Engine) -> None:
        if not event.contains(engine, "first_connect", self._ask_wsrep):
            event.listen(engine, "first_connect", self._ask_wsrep)

    def prepare_database(self, engine: Engine) -> None:
        # An engine that connected before the queue configured it missed the
        # first connect: ask on a connection of its own.
        if self._galera is None:
            with engine.connect() as conn:
                self._galera = _wsrep_on(conn.connection.dbapi_connection)

    def _ask_wsrep(self, dbapi_connection: Any, connection_record: Any) -> None:
        self._galera = _wsrep_on(dbapi_connection)

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

    def limit_delete(self, statement: Delete, rows: int) -> Delete:
        # SQLAlchemy reads the option under the dialect's name: mysql:// or mariadb://.
        return statement.with_dialect_options(mysql_limit=rows, mariadb_limit=rows)

    def table_health_probe(self) -> TableHealthProbe:
        return partial(measure_table_health, label=self.label, mariadb=self.is_mariadb)

    # Under the default REPEATABLE READ a locking read also takes gap locks
    # on the index range it walked, which block enqueues into that range and
    # deadlock concurrent claimers; READ COMMITTED locks only the rows it
    # returns.  On a pooled connection it is set by SET TRANSACTION (no
    # SESSION), for that transaction alone: nothing to reset afterwards.
    locking_reads_isolation = "READ COMMITTED"

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

    def session_id(self) -> ColumnElement[Any]:
        return func.connection_id()

    def cluster_node(self, conn: Connection) -> tuple[str, str] | None:
        if not self.galera:
            return None
        # The cluster's state UUID is shared by every node; the group
        # communication UUID is this node's own (new at each start).
        rows = conn.exec_driver_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN ('wsrep_cluster_state_uuid', 'wsrep_gcomm_uuid')"
        ).all()
        found = {str(name).lower(): str(value) for name, value in rows}
        return found.get("wsrep_cluster_state_uuid", ""), found.get("wsrep_gcomm_uuid", "")

    def read_cluster_writes(self, conn: Connection) -> None:
        if self.galera:
            # A node applies other nodes' certified writes a moment later;
            # wsrep_sync_wait = 1 makes this session's reads wait for them.
            conn.exec_driver_sql("SET SESSION wsrep_sync_wait = 1")

    @contextmanager
    def bounded_lock_wait(self, conn: Connection, seconds: float) -> Iterator[None]:
        # InnoDB counts its lock wait in whole seconds, and only per session:
        # the session's own value is put back afterwards.
        before = conn.exec_driver_sql("SELECT @@SESSION.innodb_lock_wait_timeout").scalar()
        conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(math.ceil(seconds), 1)}")
        try:
            yield
        finally:
            conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {int(before or 50)}")

    def lock_wait_ran_out(self, error: BaseException | None) -> bool:
        args: tuple[Any, ...] = getattr(error, "args", ())
        return bool(args) and args[0] == ER_LOCK_WAIT_TIMEOUT

    def outage(self, error: BaseException) -> bool | None:
        # PyMySQL files every server error it has no class for (an unknown
        # column, 1054, among them) under OperationalError: the error number
        # tells an outage from a refusal.
        args = getattr(error, "args", ())
        code = args[0] if args else None
        if not isinstance(code, int) or isinstance(code, bool) or code == 0:
            return None
        if code == ER_UNKNOWN_COM_ERROR:
            # A Galera node not (yet, or no longer) in the cluster's primary
            # component refuses every statement with 1047, "WSREP has not yet
            # prepared node for application use": it is joining after a
            # restart, or cut off from the others; it serves again once synced.
            return self.galera or "wsrep" in str(error).lower()
        return CLIENT_ERRORS[0] <= code <= CLIENT_ERRORS[1] or code in OUTAGE_ERRORS

    def certification_conflict(self, error: BaseException) -> bool:
        # Galera certifies a transaction's writes against the other nodes'
        # at COMMIT, and fails the later of two that touched one row with
        # ER_LOCK_DEADLOCK; a local transaction an applied write set aborts
        # (a brute-force abort) gets the same error at its next statement.
        return self.galera and self.lost_lock_race(error)

    def advisory_locks_not_exclusive(self) -> str | None:
        if not self.galera:
            return None
        return (
            "this MariaDB server is a Galera node (wsrep_on), and GET_LOCK is held by one node only: "
            "a worker connected to another node takes the same lock, so two workers could claim one "
            "task. Use skip_locked (the default) or conditional_update, which the cluster certifies "
            "at commit"
        )

    def lost_lock_race(self, error: BaseException) -> bool:
        # ER_LOCK_DEADLOCK: InnoDB picked this transaction as a deadlock's
        # victim and rolled it back (it locks unique index entries in gaps,
        # so even claimers that take slots in one order can meet).
        args: tuple[Any, ...] = getattr(error, "args", ())
        return bool(args) and args[0] == ER_LOCK_DEADLOCK

    def duplicate_key(self, error: BaseException | None, index: str) -> bool:
        # ER_DUP_ENTRY (1062): "Duplicate entry '...' for key '<index>'" (MySQL
        # 8 writes '<table>.<index>').
        args: tuple[Any, ...] = getattr(error, "args", ())
        return bool(args) and args[0] == DUPLICATE_ENTRY and super().duplicate_key(error, index)

    def node_partition(self, conn: Connection) -> tuple[int, int, int] | None:
        # A Galera node's place in the cluster's current membership: its index
        # (from 0) and the cluster's size.  A server without Galera reports
        # size 0 and an index of 2**64 - 1, as does a node outside the primary
        # component.  Galera also numbers new rows in steps of the cluster's
        # size, each node from its own offset (wsrep_auto_increment_control).
        row = conn.exec_driver_sql(
            "SELECT (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS"
            " WHERE VARIABLE_NAME = 'WSREP_LOCAL_INDEX'),"
            " (SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS"
            " WHERE VARIABLE_NAME = 'WSREP_CLUSTER_SIZE'),"
            " @@auto_increment_increment"
        ).one()
        try:
            index, nodes, stride = (int(value) for value in row)
        except (TypeError, ValueError):
            return None
        return (index, nodes, max(stride, 1)) if 0 <= index < nodes else None

    def datetime_type(self) -> TypeEngine[Any]:
        # DATETIME has whole seconds unless asked for fsp=6.
        return mysql.DATETIME(fsp=6)

    def long_text_type(self) -> TypeEngine[Any]:
        # TEXT stops at 64 KiB; a traceback can be longer.
        return mysql.MEDIUMTEXT()


#: MySQL's and MariaDB's "Deadlock found when trying to get lock".
ER_LOCK_DEADLOCK = 1213
#: "Lock wait timeout exceeded; try restarting transaction".
ER_LOCK_WAIT_TIMEOUT = 1205
#: ER_UNKNOWN_COM_ERROR, which a Galera node outside the primary component answers every statement with.
ER_UNKNOWN_COM_ERROR = 1047


def _wsrep_on(dbapi_connection: Any) -> bool:
    """Whether the server is a Galera node: ``wsrep_on`` is ON (MariaDB has the variable, OFF, without
    Galera; MySQL has none, and SHOW VARIABLES then returns no row rather than an error)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SHOW GLOBAL VARIABLES LIKE 'wsrep_on'")
        row = cursor.fetchone()
    except Exception:  # noqa: BLE001 - a server (or proxy) that will not say is no cluster we can tell of
        return False
    finally:
        cursor.close()
    return row is not None and str(row[1]).upper() == "ON"


def _lock_name(namespace: int, key: int) -> str:
    return f"sa_taskqueue:{namespace & 0xFFFFFFFF:08x}:{key}"


__all__ = [
    "CLIENT_ERRORS",
    "DUPLICATE_ENTRY",
    "MARIADB_SKIP_LOCKED_SINCE",
    "MYSQL_SKIP_LOCKED_SINCE",
    "OUTAGE_ERRORS",
    "MySQLBackend",
]
