"""The self-test: does this database connection give the queue what its strategy and its workers rely on?

Some deployments break the queue's locks without an error.  Behind PgBouncer
(or any pooler) in transaction pooling mode, a session-level advisory lock
stays on whichever server session ran the statement, and a LISTEN waits on a
session the client no longer holds; a server that accepts ``FOR UPDATE SKIP
LOCKED`` and ignores it (TiDB) lets two claims wait on, or take, one row.
Users would learn of it from tasks run twice.  So a worker proves its footing
when it starts, and ``sa-taskqueue doctor`` does on demand.

Each check runs on two connections of its own, against the same code the
claim uses.  The first is the queue engine's own; the second comes from a
short-lived pool of the self-test's own, made with ``engine.pool.recreate()``:
the same creator (so the same URL, pooler included), the same connect-time
setup, the same engine events, but not the application's pool.  A pool of
one connection (``pool_size=1, max_overflow=0``) can lend only one at a time,
and a check that held it while waiting for a second would wait forever: so
no check ever holds two connections of the queue's pool at once.

- ``skip_locked``: a probe row in the control table, locked ``FOR UPDATE`` on
  one connection, is read by the other through the strategy's own SKIP LOCKED
  select, under a short lock timeout: it must come back empty, at once.
- ``advisory_lock``: a lock taken on one connection is refused to the other,
  and still held after the first connection's next transaction; the server
  session of each statement is asked (``pg_backend_pid()``), so a pooler
  that moves sessions between clients is named as such.
- ``conditional_update``: two connections race one compare-and-set UPDATE
  of a probe row; exactly one wins (on SQLite, the loser is refused while the
  winner holds the write lock).
- ``listen``: a NOTIFY committed on one connection reaches another that
  LISTENs (the worker's listener connection), within `LISTEN_WAIT` seconds.
- ``cluster`` (a Galera node, `Backend.galera`): row locks and GET_LOCK are
  local to a node there, so the checks above prove exclusivity among one
  node's connections only.  Given a second node's URL, one connection on
  each node takes the same probe row (each under its own node's lock) and
  both commit: exactly one commit must be certified, the other refused as a
  certification conflict.  Without it the check says what one node cannot
  prove, and passes.

The probe rows (kind ``footing`` in the control table) and advisory locks (a
negative key, which no task id has) belong to one run each and are removed
at its end, so workers starting together do not disturb each other.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import URL, Connection, Engine, Table, create_engine, delete, func, insert, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import NullPool, Pool, PoolProxiedConnection, SingletonThreadPool, StaticPool

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.control import control_table_of
from sa_taskqueue.core.exceptions import Check, FootingError, FootingReport, translate_database_errors
from sa_taskqueue.core.notify import can_listen, listening_engine
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.ports import QueueContext
from sa_taskqueue.features.transactional import out_of_autocommit
from sa_taskqueue.strategies.advisory import AdvisoryLocks, AdvisoryLockStrategy
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy

#: The control table's ``kind`` of the self-test's probe rows.
PROBE_KIND = "footing"
#: How long the SKIP LOCKED probe may wait for a lock before it counts as blocked.
LOCK_WAIT = 0.5
#: How long the listening connection waits for the probe's notification.
LISTEN_WAIT = 2.0
#: The bound of a write expected to be refused at once (SQLite's second writer).
REFUSED_AT_ONCE = 0.01

TRANSACTION_POOLING = "PgBouncer (or another pooler) in transaction pooling mode"
SESSION_FIX = "put the workers behind a pooler in session mode, or connect them to the server directly"


def check_footing(
    queue: QueueContext, *, listen: bool = True, second_node: str | URL | None = None
) -> FootingReport:
    """Run the checks the queue's strategy needs, and LISTEN's where a worker would listen.

    ``listen=False`` leaves LISTEN out (a worker that polls).  On a node of
    a cluster (Galera), ``second_node`` is the URL of another node of it
    (the same driver as the queue's engine): exclusivity is then proved
    across the two.  A database that cannot be reached raises
    `DatabaseUnavailable`, as any other call of the queue does: that is not
    a finding about the deployment.
    """
    strategy = queue.strategy
    checks: list[Check] = []
    spare = SpareConnections(queue.engine)
    try:
        for name, run in _lock_checks(strategy):
            checks.append(_timed(name, partial(queue.call, partial(run, queue, strategy, spare))))
        if second_node is not None or backend_for(queue.engine.dialect).galera:
            checks.append(_timed("cluster", partial(_cluster, queue, second_node)))
        if listen and can_listen(queue.engine):
            checks.append(_timed("listen", partial(_listen, queue, spare)))
    finally:
        # (An async engine's connections close on its loop, as they were opened.)
        queue.call(spare.dispose)
    return FootingReport(tuple(checks))


class SpareConnections:
    """The self-test's second connections: from a pool of its own, never from the application's.

    The pool is ``engine.pool.recreate()``, made at the first connection
    and disposed of by `dispose`: it connects with the same creator and runs
    the same pool events (the dialect's setup of each new connection, the
    backend's own), and each connection is wrapped in a `Connection` of the
    queue's engine, so its engine events and execution options apply too.
    What the check proves about two connections through this URL therefore
    holds for the worker's.  Pools that hand every borrower one shared DBAPI
    connection (`StaticPool`, `SingletonThreadPool`: SQLite in memory) are
    used as they are: a pool of their own would open another, empty,
    database.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.shares_one = isinstance(engine.pool, SingletonThreadPool | StaticPool)
        self._pool: Pool | None = None

    def connect(self) -> Connection:
        """A connection of the queue's engine, taken from the self-test's own pool."""
        if self.shares_one:
            return self.engine.connect()
        return Connection(self.engine, connection=self.raw())

    def raw(self) -> PoolProxiedConnection:
        """A DBAPI connection of the self-test's own pool (a LISTEN's: it is invalidated, never reused)."""
        if self.shares_one:
            return self.engine.raw_connection()
        if self._pool is None:
            self._pool = self.engine.pool.recreate()
        return self._pool.connect()

    def dispose(self) -> None:
        """Close what the self-test's pool still holds; a later `connect` makes a new pool."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.dispose()


Finding = tuple[bool, str]
LockCheck = Callable[["QueueContext", ClaimStrategy, SpareConnections], Finding]


def _lock_checks(strategy: ClaimStrategy) -> list[tuple[str, LockCheck]]:
    """The locking checks a strategy relies on (none for a strategy this module does not know)."""
    if isinstance(strategy, SkipLockedStrategy):
        return [("skip_locked", _skip_locked)]
    if isinstance(strategy, AdvisoryLockStrategy):
        return [("advisory_lock", _advisory_lock)]
    if isinstance(strategy, ConditionalUpdateStrategy):
        return [("conditional_update", _conditional_update)]
    return []


def _timed(name: str, run: Callable[[], Finding]) -> Check:
    started = time.perf_counter()
    passed, detail = run()
    return Check(name, passed, detail, time.perf_counter() - started)


# SKIP LOCKED -----------------------------------------------------------------------


def _skip_locked(queue: QueueContext, strategy: ClaimStrategy, spare: SpareConnections) -> Finding:
    engine = queue.engine
    backend = backend_for(engine.dialect)
    control = control_table_of(queue.table)
    with translate_database_errors(engine, queue.table), _probe_row(engine, control) as probe:
        # Row locks last as long as a transaction: not in AUTOCOMMIT, where
        # the holder's lock would end with its statement.
        holder = out_of_autocommit(engine.connect())
        reader = out_of_autocommit(spare.connect())
        clean = False
        try:
            holder.begin()
            backend.begin_locking_reads(holder)
            if not holder.execute(probe.select().with_for_update()).all():
                raise FootingError(f"the self-test's probe row in {control.name} cannot be read back")
            reader.begin()
            backend.begin_locking_reads(reader)
            try:
                with backend.bounded_lock_wait(reader, LOCK_WAIT):
                    # The strategy's own locking read: a strategy, or a server,
                    # that drops SKIP LOCKED fails here.
                    seen = reader.execute(strategy.lock_rows(reader, probe.select())).all()
            except DBAPIError as error:
                if not backend.lock_wait_ran_out(error.orig):
                    raise
                found = False, _ignores_skip_locked(backend.label, "blocked on it")
            else:
                found = (
                    (False, _ignores_skip_locked(backend.label, "returned it"))
                    if seen
                    else (True, "a row locked by one connection was skipped by another, at once")
                )
            reader.rollback()
            holder.rollback()
            clean = True
        finally:
            _close(reader, clean)
            _close(holder, clean)
    return found


def _ignores_skip_locked(label: str, what: str) -> str:
    return (
        f"{label} accepted FOR UPDATE SKIP LOCKED on a row another connection had locked, and {what}: "
        "it does not honour SKIP LOCKED (TiDB does this), so claims would wait on each other or take "
        "one task twice. Use strategy='conditional_update' on this database"
    )


# Advisory locks ---------------------------------------------------------------------


def _advisory_lock(queue: QueueContext, strategy: ClaimStrategy, spare: SpareConnections) -> Finding:
    engine = queue.engine
    backend = backend_for(engine.dialect)
    locks = AdvisoryLocks(engine, queue.table)
    # A negative key: no task id takes it, and each run has its own.
    key = -(secrets.randbelow(2**31 - 2) + 1)
    unlock = select(backend.advisory_unlock(locks.namespace, key))
    with translate_database_errors(engine, queue.table):
        # Autocommit, as the strategy's claims run: each statement is a transaction of its own.
        holder = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        other = spare.connect().execution_options(isolation_level="AUTOCOMMIT")
        clean = False
        try:
            holder_sessions = [_session(holder)]
            taken = locks.try_lock(holder, [key]) == [key]
            other_session = _session(other)
            granted = bool(locks.try_lock(other, [key]))
            if granted:
                other.execute(unlock)
            holder_sessions.append(_session(holder))
            granted = bool(locks.try_lock(other, [key])) or granted
            if granted:
                other.execute(unlock)
            kept = taken and holder.execute(unlock).scalar() in (True, 1)
            clean = True
        finally:
            _close(holder, clean)
            _close(other, clean)
    pooled = _shared_sessions(holder_sessions, other_session)
    if pooled is not None:
        return False, (
            f"{TRANSACTION_POOLING}: {pooled}, so advisory locks do not survive across transactions "
            "and another connection can take a lock a worker holds. Use the skip_locked strategy and "
            f"polling (listen=False, --no-listen), or {SESSION_FIX}"
        )
    if not taken:
        return False, "a free advisory lock could not be taken: is the lock table full? Use skip_locked"
    if granted:
        return False, (
            "an advisory lock held by one connection was granted to another (a pooler between the "
            f"workers and the server?). Use the skip_locked strategy, or {SESSION_FIX}"
        )
    if not kept:
        return False, (
            "an advisory lock was gone after its connection's next transaction (a pooler in transaction "
            f"mode?). Use the skip_locked strategy and polling (listen=False, --no-listen), or {SESSION_FIX}"
        )
    return True, "a lock held by one connection was refused to another, and kept across its transactions"


def _session(conn: Connection) -> object:
    """The server session ``conn``'s next statement runs in, where the backend can say."""
    call = backend_for(conn.dialect).session_id()
    return None if call is None else conn.execute(select(call)).scalar()


def _shared_sessions(holder: list[object], other: object) -> str | None:
    """How two client connections' server sessions show a transaction-mode pooler, or None if they do not."""
    first, later = holder
    if first is None:
        return None
    if first != later:
        return f"one client connection moved from server session {first} to {later} between two transactions"
    if other in holder:
        return f"two client connections both ran on server session {other}"
    return None


# Conditional UPDATE ---------------------------------------------------------------------


def _conditional_update(queue: QueueContext, strategy: ClaimStrategy, spare: SpareConnections) -> Finding:
    engine = queue.engine
    backend = backend_for(engine.dialect)
    if isinstance(engine.pool, SingletonThreadPool | StaticPool):
        # An in-memory SQLite database: one connection, nothing can race it.
        return True, "one shared connection (an in-memory database): no other connection can race a claim"
    control = control_table_of(queue.table)
    with translate_database_errors(engine, queue.table), _probe_row(engine, control) as probe:
        take = probe.take()
        rival = spare.connect().execution_options(isolation_level="AUTOCOMMIT")
        clean = False
        try:
            # The winner takes the row in a transaction of the strategy's own
            # kind (BEGIN IMMEDIATE on SQLite), and the rival tries meanwhile.
            won_meanwhile = 0
            with strategy.transaction(engine) as winner:
                won = winner.execute(take).rowcount
                if backend.serialised_writes:
                    try:
                        with backend.bounded_lock_wait(rival, REFUSED_AT_ONCE):
                            won_meanwhile = rival.execute(take).rowcount
                    except DBAPIError as error:
                        if not backend.lock_wait_ran_out(error.orig):
                            raise
            won_after = rival.execute(take).rowcount
            clean = True
        finally:
            _close(rival, clean)
    if won == 1 and won_meanwhile == 0 and won_after == 0:
        return True, "of two connections racing one compare-and-set UPDATE, exactly one won"
    return False, (
        f"of two connections racing one compare-and-set UPDATE, {won + won_meanwhile + won_after} won "
        f"(winner {won}, rival while the winner wrote {won_meanwhile}, rival after {won_after}): "
        "claims would hand one task to two workers. Is the database file on a network file system "
        "without working locks? Keep it on a local disk"
    )


# Across the nodes of a cluster -------------------------------------------------------------

ONE_NODE = (
    "this server is a Galera node (wsrep_on): row locks and GET_LOCK hold on one node only, so the "
    "checks above prove a claim's exclusivity among this node's connections alone; across nodes it "
    "rests on the cluster certifying each commit, which one node cannot show. Give a second node's "
    "URL (--second-node) to prove it"
)


def _cluster(queue: QueueContext, second_node: str | URL | None) -> Finding:
    """Exclusivity across two nodes: each takes one probe row under its own lock; one commit may stand."""
    if second_node is None:
        return True, ONE_NODE
    other_engine = _engine_like(queue, second_node)
    try:
        return queue.call(partial(_race_two_nodes, queue, other_engine))
    finally:
        queue.call(other_engine.dispose)


def _engine_like(queue: QueueContext, url: str | URL) -> Engine:
    """An engine of no pool on ``url``, of the queue's kind (an `AsyncEngine`'s sync face if it is async)."""
    if queue.is_async:
        from sqlalchemy.ext.asyncio import create_async_engine

        engine = create_async_engine(url, poolclass=NullPool).sync_engine
    else:
        engine = create_engine(url, poolclass=NullPool)
    # Set up as a queue's engine is: its first connect learns what the server is.
    backend_for(engine.dialect).configure_engine(engine)
    return engine


def _race_two_nodes(queue: QueueContext, other_engine: Engine) -> Finding:
    engine = queue.engine
    backend = backend_for(engine.dialect)
    other_backend = backend_for(other_engine.dialect)
    control = control_table_of(queue.table)
    with translate_database_errors(engine, queue.table), _probe_row(engine, control) as probe:
        first = out_of_autocommit(engine.connect())
        second = out_of_autocommit(other_engine.connect())
        clean = False
        try:
            here, there = backend.cluster_node(first), other_backend.cluster_node(second)
            if here is None or there is None:
                which = "this server" if here is None else "the second node"
                return False, (
                    f"{which} is not a Galera node (wsrep_on is OFF): a second node's URL proves "
                    "exclusivity across the nodes of a cluster, and there is none here"
                )
            if here[0] != there[0]:
                return False, "the second URL reaches a node of another cluster: give a node of this one"
            if here[1] == there[1]:
                return False, "the second URL reaches this very node: give another node of the cluster"
            # The probe row was committed on the first node: the second reads
            # once it has applied that.
            other_backend.read_cluster_writes(second)
            first.rollback()  # (the questions above began transactions: the race begins its own)
            second.rollback()
            take = probe.take()
            first.begin()
            took_first = first.execute(take).rowcount
            second.begin()
            # Row locks are the node's own: this takes the row the first
            # connection has locked on its node, without waiting.
            took_second = second.execute(take).rowcount
            first.commit()
            refused = False
            try:
                second.commit()
            except DBAPIError as error:
                if error.orig is None or not other_backend.certification_conflict(error.orig):
                    raise
                refused = True
            clean = True
        finally:
            _close(second, clean)
            _close(first, clean)
    won = took_first + (0 if refused else took_second)
    if won == 1:
        how = (
            "the other commit was refused as a certification conflict"
            if refused
            else "the other found the row taken"
        )
        return True, (
            f"two connections on two nodes took one row, each under its own node's lock; one commit "
            f"was certified and {how}, so workers on different nodes cannot both claim a task"
        )
    return False, (
        f"two connections on two nodes took one row and {won} commits stood: the cluster does not "
        "certify writes across these nodes, and workers on them could run one task twice. Run every "
        "worker against one node"
    )


# LISTEN ----------------------------------------------------------------------------------


def _listen(queue: QueueContext, spare: SpareConnections) -> Finding:
    """LISTEN as the worker's listener does, NOTIFY from the queue's engine, and wait for it.

    The listening connection of a sync engine comes from the self-test's own
    pool: the NOTIFY needs one of the queue's pool meanwhile.  (An async
    engine's listener has an engine of its own already.)
    """
    engine = queue.engine
    backend = backend_for(engine.dialect)
    channel = f"sa_taskqueue_footing_{secrets.token_hex(8)}"
    payload = secrets.token_hex(8)
    quote = engine.dialect.identifier_preparer.quote
    session_call = backend.session_id()
    ask_session = None if session_call is None else str(select(session_call).compile(dialect=engine.dialect))
    listener_engine = listening_engine(engine)
    with translate_database_errors(engine, queue.table):
        raw = spare.raw() if listener_engine is engine else listener_engine.raw_connection()
        try:
            driver: Any = raw.driver_connection
            driver.autocommit = True
            driver.execute(f"LISTEN {quote(channel)}")
            listener_session = driver.execute(ask_session).fetchone()[0] if ask_session else None
            notifier_session = queue.call(lambda: _notify(engine, channel, payload))
            arrived = any(
                note.channel == channel and note.payload == payload
                for note in driver.notifies(timeout=LISTEN_WAIT, stop_after=1)
            )
        finally:
            raw.invalidate()  # as the listener does: a LISTENing connection never goes back to a pool
            if listener_engine is not engine:
                listener_engine.dispose()
    if arrived:
        return True, "a NOTIFY committed on one connection reached another LISTENing one"
    fix = f"Run workers with listen=False (--no-listen), and they poll every poll_interval, or {SESSION_FIX}"
    if listener_session is not None and listener_session == notifier_session:
        return False, (
            f"{TRANSACTION_POOLING}: the listening and the notifying connection both ran on server session "
            f"{listener_session}, so notifications never reach a listening worker. {fix}"
        )
    return False, (
        f"a NOTIFY committed on one connection did not reach another LISTENing one within {LISTEN_WAIT:g}s "
        f"(a pooler in transaction mode, or a proxy that drops notifications?). {fix}"
    )


def _notify(engine: Engine, channel: str, payload: str) -> object:
    with engine.connect() as conn:
        session = _session(conn)
        conn.execute(select(func.pg_notify(channel, payload)))
        conn.commit()
    return session


# Shared --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe:
    """One probe row of the control table, as the statements on it."""

    control: Table
    name: str

    def select(self) -> Any:
        return select(self.control.c.name).where(*self._where())

    def take(self) -> Any:
        """A compare-and-set, as a claim is: it matches the row only while nobody has taken it."""
        return (
            update(self.control)
            .where(*self._where(), self.control.c.held_by.is_(None))
            .values(held_by=self.name, updated_at=utcnow())
        )

    def _where(self) -> tuple[Any, ...]:
        return (self.control.c.kind == PROBE_KIND, self.control.c.name == self.name)


@contextmanager
def _probe_row(engine: Engine, control: Table) -> Iterator[_Probe]:
    """A committed probe row of this run's own for the block, deleted after it."""
    probe = _Probe(control, f"probe-{secrets.token_hex(12)}")
    with engine.begin() as conn:
        conn.execute(insert(control).values(kind=PROBE_KIND, name=probe.name, updated_at=utcnow()))
    try:
        yield probe
    finally:
        with engine.begin() as conn:
            conn.execute(delete(control).where(*probe._where()))


def _close(conn: Connection, clean: bool) -> None:
    """Give a connection back; one left mid-way (a lock, a setting, a failed wait) is closed for good."""
    if not clean:
        conn.invalidate()
    conn.close()


__all__ = ["LISTEN_WAIT", "LOCK_WAIT", "PROBE_KIND", "Check", "FootingReport", "check_footing"]
