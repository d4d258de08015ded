"""`Backend`: what the queue needs to know about one database, as named capabilities.

The base class describes a plain SQL database that SQLAlchemy compiles for
(the ``"*"`` default): no row locks the queue relies on, no advisory locks, no
notifications, standard types.  Each database family overrides what differs,
in a module of its own, with the reason on the line.  Strategies, types, the
model's migrations and the worker ask a backend; none of them tests a
dialect's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from sqlalchemy import JSON, URL, ColumnElement, Connection, DateTime, Delete, Engine, Insert, Table, Text
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeEngine

if TYPE_CHECKING:
    from sa_taskqueue.backends.table_health.figures import TableHealth
    from sa_taskqueue.backends.table_health.thresholds import HealthThresholds
    from sa_taskqueue.backends.write_gate import WriteGate

#: Execution option: how many rows the driver may fetch per round trip, where
#: a backend sizes its fetches (`Backend.configure_engine`); ignored elsewhere.
FETCH_ROWS_OPTION = "sa_taskqueue_fetch_rows"

#: The claim strategies a backend may name as its default (`Backend.default_strategy`).
SKIP_LOCKED = "skip_locked"
CONDITIONAL_UPDATE = "conditional_update"

#: Measures a task table's health at a moment against thresholds; None when
#: it finds no such table (see `Backend.table_health_probe`).
TableHealthProbe = Callable[[Connection, Table, datetime, "HealthThresholds"], "TableHealth | None"]


class BulkCopier(Protocol):
    """Rows into a table by the driver's COPY protocol, on one connection in its transaction."""

    def copy(
        self, table: Table, names: Sequence[str], count: int, values: Callable[[], Sequence[Iterable[Any]]]
    ) -> list[int] | None:
        """Insert ``count`` rows of the columns ``names``, with new ids; the ids, ascending with the rows.

        ``values()`` gives each column's values, bind-processed, in the
        order of ``names``; it is called only once the COPY will run.  None,
        with nothing written, where the ids cannot be drawn before the rows
        go (no sequence behind the id column): the caller inserts another way.
        """
        ...


class Backend:
    """One SQLAlchemy dialect as the queue sees it; created by `backend_for`, cheap to make."""

    #: Shown in messages ("PostgreSQL", "MariaDB").
    label = "this database"

    # Claiming ------------------------------------------------------------------

    #: The dialect renders ``FOR UPDATE SKIP LOCKED`` and the server honours it
    #: (from `skip_locked_since` on, where that is set).
    skip_locked = False
    #: The first server version with SKIP LOCKED, where older ones are in use.
    skip_locked_since: tuple[int, ...] | None = None
    #: A locked, limited SELECT can be a CTE that ``UPDATE ... FROM`` joins and
    #: ``RETURNING`` reads back: a claim in one statement.
    update_from_locked_cte = False
    #: ``LIMIT`` (or its equivalent) may stand beside ``FOR UPDATE``.
    limit_with_for_update = True
    #: One writer at a time for the whole database, and a writing statement
    #: takes that lock before it reads, so an ``UPDATE ... WHERE id IN
    #: (SELECT ... LIMIT n)`` cannot race another writer.
    serialised_writes = False

    # Retention -------------------------------------------------------------------

    #: A batch of old rows is deleted by ``DELETE ... LIMIT n`` itself, because
    #: an ``IN`` subquery may not have a LIMIT here; elsewhere by ``DELETE ...
    #: WHERE id IN (SELECT id ... LIMIT n)`` (FETCH FIRST on Oracle), which
    #: standard SQL allows and plain DELETE does not.
    delete_with_limit = False

    # Indexes and keys ---------------------------------------------------------------

    #: An index may hold only the rows a WHERE clause selects (the queued
    #: ones), so finished rows cost the claim nothing.
    partial_indexes = False
    #: A generated column can be indexed only if it is stored (computed when
    #: the row is written), so the model's generated columns are declared STORED.
    indexes_only_stored_generated_columns = False
    #: Only an ``INTEGER`` primary key numbers new rows by itself (a rowid
    #: alias), not a ``BIGINT`` one, so the model's id is an INTEGER here.
    autoincrement_needs_integer_key = False
    #: Columns added to the task table after its generated columns are
    #: written without a length: ALTER TABLE ADD COLUMN appends each one's DDL
    #: to the stored CREATE statement, and a ``VARCHAR(255)`` after a
    #: generated column's expression ends SQLAlchemy's reading of that
    #: expression at the wrong parenthesis.  Lengths mean nothing here.
    appended_columns_without_length = False

    # Bulk enqueue ----------------------------------------------------------------

    #: Many rows go as one array per column, unpacked by ``unnest`` in one
    #: ``INSERT ... SELECT``: a few parameters whatever the row count.
    insert_from_arrays = False
    #: A multi-row INSERT numbers its rows in order and nothing else writes
    #: meanwhile, so the new ids sorted are the rows in order.
    multi_row_insert_ids_in_order = False
    #: Many rows may go through the driver's COPY protocol, where the
    #: connection's driver has one (`bulk_copier`).
    insert_by_copy = False
    #: The most values one statement may bind (MySQL's protocol counts them in 16 bits).
    max_bound_values = 65535

    # Unique tasks ----------------------------------------------------------------

    #: An INSERT can skip a row that clashes with the unique-key index and go
    #: on (``ON CONFLICT (...) WHERE ... DO NOTHING``), leaving the transaction
    #: as it was.  Without it the INSERT runs inside a SAVEPOINT, rolled back
    #: on the duplicate-key error (`duplicate_key`).
    insert_skips_conflicts = False
    #: A plain SELECT in an open transaction may miss a row another one
    #: committed since this transaction's first read (a REPEATABLE READ
    #: snapshot), so the task a duplicate key points at is read with a
    #: locking read, which sees the latest committed row.
    snapshot_reads = False

    # Statements and connections --------------------------------------------------

    #: Single statements (a claim, a completion) run in the driver's autocommit
    #: mode, because BEGIN and COMMIT would each cost a round trip.
    autocommit_statements = False
    #: What opens a transaction that is going to write, when the driver's own
    #: implicit BEGIN is not enough; None for the driver's default.
    write_begin: str | None = None
    #: The driver binds every value correctly from the value alone, so hot
    #: statements can run as compiled SQL with pre-processed parameters.  Off
    #: unless a backend knows its drivers: others may need SQLAlchemy's input
    #: sizes or parameter handling, which only the full execution path applies.
    direct_execution = False
    #: A worker claims its next tasks while its finished ones are still being
    #: written, on a second connection: the two writes overlap on the server.
    #: Off where writers queue for one lock (SQLite), so the claim would only
    #: wait, and where measurements found no gain (MySQL, MariaDB).
    claims_ahead = False
    #: Many tasks complete in one statement whose claims go as an array of ids
    #: and one JSON document (``UPDATE ... FROM json_to_recordset(...)``),
    #: whatever the batch size.
    completes_from_arrays = False
    #: The isolation level `begin_locking_reads` sets, or None.  The
    #: connections a strategy whose claims are locking reads keeps for its
    #: hot statements are set to it once, when checked out (SQLAlchemy sets
    #: the pool's level back when they return), so their transactions need no
    #: statement of their own for it.
    locking_reads_isolation: str | None = None
    #: What turns a statement into a request for its plan.
    explain_prefix = "EXPLAIN "

    # Notifications --------------------------------------------------------------

    #: An enqueue can wake listening workers at commit (``NOTIFY``).
    notify = False

    # Drivers ---------------------------------------------------------------------

    #: The package extra (``pip install 'sa_taskqueue[<extra>]'``) that installs
    #: this database's recommended driver; None where Python has one built in.
    driver_extra: str | None = None
    #: The driver modules (top-level names) that extra installs.
    driver_modules: frozenset[str] = frozenset()
    #: The asyncio driver modules the ``async`` extra installs for this database.
    async_driver_modules: frozenset[str] = frozenset()
    #: SQLAlchemy's driver for a URL that names none, where no extra installs
    #: it: (its module, the URL scheme naming the driver the extra installs).
    unnamed_driver: tuple[str, str] | None = None
    #: asyncio drivers (the module SQLAlchemy's adapter for each lives in, by
    #: its last name) whose connections wait on futures of the event loop
    #: that opened them, so they cannot be used, nor closed gracefully, from another.
    loop_bound_drivers: frozenset[str] = frozenset()
    #: The names other tools write in a URL's scheme for this database, which
    #: SQLAlchemy has no dialect for (it answers "Can't load plugin").
    scheme_aliases: frozenset[str] = frozenset()
    #: The URL's database is a file path, which the driver creates when it
    #: is missing.
    file_database = False

    # Migrations -----------------------------------------------------------------

    #: ALTER TABLE is too limited, so autogenerate must emit batch (copy and move) operations.
    batch_migrations = False

    # Types ----------------------------------------------------------------------

    #: The database keeps no time zone: the queue stores the UTC wall time and
    #: marks values read back as UTC.
    stores_naive_utc = False
    #: JSON documents are stored as text serialised by the queue, not a native type.
    json_as_text = False
    #: The driver decodes JSON columns itself while rows are fetched, so a claim
    #: that must decode each row's params on its own reads them cast to text.
    driver_decodes_json = False

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect

    @property
    def name(self) -> str:
        """The registry's name for this server: the dialect's, except where one dialect serves two servers."""
        return str(self.dialect.name)

    @property
    def server_version(self) -> tuple[int, ...]:
        """The connected server's version; empty before the engine's first connect."""
        return tuple(part for part in self.dialect.server_version_info or () if isinstance(part, int))

    @property
    def update_returning(self) -> bool:
        """``UPDATE ... RETURNING`` (or Oracle's RETURNING INTO) reads back the rows written."""
        return bool(self.dialect.update_returning)

    @property
    def multi_row_insert_returning(self) -> bool:
        """A multi-row INSERT returns the new ids in the order of its rows."""
        return bool(getattr(self.dialect, "insert_executemany_returning_sort_by_parameter_order", False))

    @property
    def listen(self) -> bool:
        """Idle workers can wait on ``LISTEN`` for the notifications an enqueue sends."""
        return False

    @property
    def advisory_locks(self) -> bool:
        """Session-level locks on a name or number, held across transactions until released."""
        return False

    @property
    def galera(self) -> bool:
        """The server is a node of a MariaDB Galera cluster (synchronous multi-primary replication).

        Detected from the server, cached per engine; known after the
        engine's first connect.  Row locks and advisory locks are then local
        to one node: the cluster decides between two nodes' writes to one
        row at commit (certification), failing the later one
        (`certification_conflict`).
        """
        return False

    def advisory_locks_not_exclusive(self) -> str | None:
        """Why an advisory lock held here would not keep other workers out although the server has them.

        None where it would.  Known after the engine's first connect.
        """
        return None

    def listener_url(self, url: URL) -> URL | None:
        """The URL a listener of an asyncio engine at ``url`` connects through, with a sync driver.

        None where no installed sync driver can wait for notifications:
        the workers of an asyncio engine then poll.
        """
        return None

    def bulk_copier(self, conn: Connection) -> BulkCopier | None:
        """What copies rows in by the driver's COPY on ``conn``; None where its driver has no COPY."""
        return None

    def write_gate(self, url: URL) -> WriteGate | None:
        """The gate lease renewals pass ahead of long writes at (`sa_taskqueue.backends.write_gate`).

        None where writers do not queue for one lock: a server's row locks
        let a renewal through beside any task's transaction.
        """
        return None

    def table_health_probe(self) -> TableHealthProbe | None:
        """What measures a task table's health here (`sa_taskqueue.health`); None where nothing does."""
        return None

    def has_skip_locked(self) -> bool:
        """SKIP LOCKED works on the connected server (the version is known only after a connect)."""
        if not self.skip_locked:
            return False
        return self.skip_locked_since is None or self.server_version >= self.skip_locked_since

    def node_partition(self, conn: Connection) -> tuple[int, int, int] | None:
        """This connection's server as one of several nodes that all take writes: (index, nodes, id step).

        Asked by a claim that spreads workers over a multi-primary cluster's
        nodes (`sa_taskqueue.strategies.spreading`), so that each node's
        workers take their own share of the candidates.  The index runs from
        0 to ``nodes`` less one; the id step is how far apart the ids of rows
        inserted one after another on one node are (a cluster numbering each
        node's rows from its own offset steps by the cluster's size).  None
        where the server is not such a node, or cannot say now (a node
        outside the cluster's primary component).
        """
        return None

    @property
    def default_strategy(self) -> str:
        """The name of the claim strategy this server gets unless the application chooses one.

        `SKIP_LOCKED` where the connected server has it (`has_skip_locked`:
        the version counts, so ask after the engine's first connect), else
        `CONDITIONAL_UPDATE`, which needs no row locks.
        """
        return SKIP_LOCKED if self.has_skip_locked() else CONDITIONAL_UPDATE

    # Connection setup ---------------------------------------------------------------

    def configure_engine(self, engine: Engine) -> None:
        """Settings every new connection of ``engine`` gets (events only: nothing connects here)."""

    def prepare_database(self, engine: Engine) -> None:
        """Database-wide settings the queue relies on, applied on first use of ``engine``."""

    def begin_locking_reads(self, conn: Connection) -> None:
        """Make the transaction just begun on ``conn`` fit for locking reads that skip locked rows.

        Nothing to do where the connection runs at `locking_reads_isolation`
        already (a kept connection).
        """
        level = self.locking_reads_isolation
        if level is None or conn.get_execution_options().get("isolation_level") == level:
            return
        conn.exec_driver_sql(f"SET TRANSACTION ISOLATION LEVEL {level}")

    def unindexed(self, sql: str) -> str:
        """The SQL of a text column, written so that no index, partial ones included, can serve a test of it.

        A fenced write (a completion, a lease renewal) finds its rows by their
        ids.  Its ``status = 'running'`` test lets a planner choose the lease
        index instead, a walk over every running row, when it thinks that
        index small: SQLite always, as it keeps no statistics unless asked.
        Elsewhere the SQL stays as it is.  MySQL and MariaDB measure the
        ranges as they plan.  PostgreSQL's statistics pick the lease index
        while few tasks run, the faster way then, and also after a sudden
        rise in running tasks until autovacuum's next ANALYZE; hiding the
        index from it cost more than that on a small table, which it then
        scanned whole.
        """
        return sql

    def limit_delete(self, statement: Delete, rows: int) -> Delete:
        """``statement`` deleting at most ``rows`` rows with ``DELETE ... LIMIT`` (`delete_with_limit`)."""
        raise NotImplementedError(f"{self.label} has no DELETE ... LIMIT")

    # Advisory locks -------------------------------------------------------------------

    def advisory_scope(self, engine: Engine, table: Table) -> str:
        """What an advisory lock name must include to be unique to ``table``."""
        raise NotImplementedError(f"{self.label} has no advisory locks")

    def try_advisory_lock(self, namespace: int, key: int) -> ColumnElement[Any]:
        """A call that takes lock ``key`` of ``namespace`` without waiting; true (or 1) if it did."""
        raise NotImplementedError(f"{self.label} has no advisory locks")

    def advisory_unlock(self, namespace: int, key: int) -> ColumnElement[Any]:
        """A call that releases lock ``key`` of ``namespace``."""
        raise NotImplementedError(f"{self.label} has no advisory locks")

    # Footing (the self-test, `sa_taskqueue.health.self_test`) ---------------------------------

    def session_id(self) -> ColumnElement[Any] | None:
        """A call naming the server session a statement runs in; None where there is none to ask.

        Two client connections that report one session, or one connection
        whose session changes between transactions, sit behind a pooler that
        hands server sessions out per transaction.
        """
        return None

    def cluster_node(self, conn: Connection) -> tuple[str, str] | None:
        """Which cluster and which node of it ``conn`` reaches, where the server is a node of one (`galera`).

        None elsewhere.  Two connections with one cluster and two nodes
        reach two nodes of the same cluster.
        """
        return None

    def read_cluster_writes(self, conn: Connection) -> None:
        """Make ``conn``'s reads wait until its node has applied what the whole cluster committed before.

        Nothing to do on a single server, which has applied it already.
        """

    def bounded_lock_wait(self, conn: Connection, seconds: float) -> AbstractContextManager[None]:
        """Within: a statement on ``conn`` waiting for another's lock gives up after about ``seconds``.

        ``conn`` is in a transaction.  Whatever is changed is put back on
        leaving.  By default nothing can be bounded here, and a wait lasts as
        long as the database lets it.
        """
        return nullcontext()

    def lock_wait_ran_out(self, error: BaseException | None) -> bool:
        """Whether the driver's ``error`` ends a wait that `bounded_lock_wait` bounded."""
        return False

    # Errors ----------------------------------------------------------------------------

    def outage(self, error: BaseException) -> bool | None:
        """Whether the driver's ``error`` says the database cannot serve now, so a retry may succeed.

        True for an unreachable or restarting server, a dropped connection, a
        deadlock or a lock wait that ran out; False for a statement refused
        for what it is (a limit exceeded, an unknown column), which would be
        refused again; None when this backend cannot tell, and the DB-API
        class decides (an ``OperationalError`` is an outage).
        """
        return None

    def lost_lock_race(self, error: BaseException) -> bool:
        """Whether the driver's ``error`` says the server rolled this transaction back to end a deadlock.

        Such a transaction did nothing wrong and may simply run again.
        """
        return False

    def certification_conflict(self, error: BaseException) -> bool:
        """Whether the driver's ``error`` says another node's transaction on the same rows won (`galera`).

        The transaction was rolled back through no fault of its own, and
        its work may run again at once: it is contention between nodes,
        not an outage and not a failure of a task.
        """
        return False

    def busy(self, error: BaseException | None) -> str | None:
        """If ``error`` is a wait for another connection's lock that ran out, what to tell people."""
        return None

    def insert_skipping_conflicts(
        self, into: Table | type[Any], key: ColumnElement[Any], index_where: ColumnElement[bool]
    ) -> Insert:
        """An INSERT into ``into`` (a table, or a mapped class) skipping a row whose ``key`` is held.

        ``key`` and ``index_where`` name the partial unique index (`insert_skips_conflicts`).
        """
        raise NotImplementedError(f"{self.label} has no INSERT that skips conflicting rows")

    def duplicate_key(self, error: BaseException | None, index: str) -> bool:
        """Whether the driver's ``error`` is a duplicate key in the unique index named ``index``.

        Any other refusal, a duplicate in another unique index included, is
        not: it goes to the caller as it is.  By default, an error whose text
        names the index (databases name the index or constraint refused).
        """
        return error is not None and index.lower() in str(error).lower()

    # Types ------------------------------------------------------------------------------

    def datetime_type(self) -> TypeEngine[Any]:
        """The column type holding an aware UTC datetime with microseconds."""
        return DateTime(timezone=True)

    def json_type(self) -> TypeEngine[Any]:
        """The column type holding a JSON document."""
        return JSON(none_as_null=True)

    def long_text_type(self) -> TypeEngine[Any]:
        """The column type holding text as long as a traceback may be."""
        return Text()


__all__ = [
    "CONDITIONAL_UPDATE",
    "FETCH_ROWS_OPTION",
    "SKIP_LOCKED",
    "Backend",
    "BulkCopier",
    "TableHealthProbe",
]
