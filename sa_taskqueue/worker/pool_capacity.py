"""Does the engine's pool have the connections this worker holds at once?  Checked as it starts.

A worker takes its connections from the application's engine, and most of
them only for a statement: a claim, a completion, a lease renewal, a
service's write.  A pool smaller than the worker serves those in turn.  Some
connections are held for longer, and a pool that cannot lend them all at once
makes the rest wait behind them:

- a transactional task holds one for its whole run (its writes and its
  completion commit together on it: `sa_taskqueue.features.transactional`);
- under ``advisory_lock`` a claim holds the connection its locks live on until
  the last of its tasks has finished: at most one per running task;
- the LISTEN connection (PostgreSQL, a sync engine: an async engine's listener
  connects through an engine of its own) is held while the worker runs;
- the strategy keeps up to two connections out of the pool for its claims and
  completions (`sa_taskqueue.strategies.kept_connection.how_many_to_keep`).

What waits behind them is, worst of all, the lease renewal: a task whose lease
is not renewed in time makes the watchdog kill the worker, a supervisor
restarts it into the same pool, and it dies again.  So `check_pool` counts
the connections held at once, plus one for a statement (a renewal, a claim
or completion when the kept ones are lent, a service's write), and:

- refuses to start (`PoolTooSmall`, naming the numbers and the fix) when
  connections held for task runs leave the pool short;
- otherwise, when only the LISTEN connection would leave it short (a pool of
  one or two), lets the worker poll instead, and says so;
- leaves alone a pool it cannot count: ``NullPool`` (a new connection each
  time), an overflow of -1 (unbounded), ``StaticPool`` and
  ``SingletonThreadPool`` (SQLite in memory: every borrower shares one
  connection, nobody waits for it).

Connections the application's own task code takes from the same engine are
the application's to count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy.engine.interfaces import DBAPIConnection
from sqlalchemy.pool import Pool, QueuePool, SingletonThreadPool, StaticPool

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.exceptions import DatabaseUnavailable, PoolTooSmall
from sa_taskqueue.core.notify import can_listen
from sa_taskqueue.strategies.advisory import AdvisoryLockStrategy
from sa_taskqueue.strategies.kept_connection import how_many_to_keep
from sa_taskqueue.worker.ports import WorkerQueue

logger = logging.getLogger("sa_taskqueue")

#: The most connections a pool would need to hold: a bound on the search for the smallest that fits.
_LARGEST_POOL = 100_000


@dataclass(frozen=True)
class ConnectionNeeds:
    """The connections one worker holds at once, counted for the pool it would run on."""

    #: Held for a task's whole run: one per slot running a transactional task.
    transactional: int
    #: Held by advisory-lock claims until their tasks finish: one per running task.
    claims: int
    #: The LISTEN connection, when it comes from the engine's pool.
    listener: int
    #: Kept out of the pool by the strategy for claims and completions.
    kept: int
    #: One statement at a time besides: a lease renewal, a claim, a completion, a service's write.
    statements: int = 1

    @property
    def total(self) -> int:
        return self.transactional + self.claims + self.listener + self.kept + self.statements

    @property
    def held_for_runs(self) -> int:
        return self.transactional + self.claims

    def parts(self) -> str:
        """The count, part by part, in words."""
        said = []
        if self.transactional:
            said.append(f"{self.transactional} for its transactional tasks (each holds one while it runs)")
        if self.claims:
            said.append(f"{self.claims} for its advisory-lock claims (each holds one while its tasks run)")
        if self.listener:
            said.append(f"{self.listener} for LISTEN")
        if self.kept:
            said.append(f"{self.kept} kept for claims and completions")
        said.append(f"{self.statements} for lease renewals and other short statements")
        return ", ".join(said)


def pool_capacity(pool: Pool) -> int | None:
    """How many connections ``pool`` lends at once, or None where nobody waits for one.

    A `QueuePool` (and the asyncio one, its subclass) lends ``pool_size``
    plus ``max_overflow``; an overflow of -1 means no limit.  `NullPool`
    opens a connection for each borrower; `StaticPool` and
    `SingletonThreadPool` hand everyone the same one (SQLite in memory):
    none of them makes a borrower wait.  (`AssertionPool`, a debugging aid,
    is not counted either.)
    """
    if isinstance(pool, QueuePool):
        overflow = getattr(pool, "_max_overflow", 0)  # (SQLAlchemy has no public accessor for it)
        return None if overflow < 0 else pool.size() + overflow
    return None


def connection_needs(
    queue: WorkerQueue, concurrency: int, *, listen: bool, pool: Pool | None = None
) -> ConnectionNeeds:
    """What a worker of ``concurrency`` slots on ``queue`` holds at once, on ``pool`` (default: the engine's).

    ``listen``: whether it would LISTEN (asked for, and not a burst).
    """
    engine = queue.engine
    pool = engine.pool if pool is None else pool
    transactional = any(
        registered is not None and registered.options.transactional
        for registered in map(queue.registered, queue.task_names)
    )
    # (The strategy keeps none of a pool whose one connection everybody shares.)
    kept = 0 if isinstance(pool, SingletonThreadPool | StaticPool) else how_many_to_keep(pool)
    # Behind a write gate (SQLite) one transactional task at a time holds a connection: the others
    # wait at the gate, before they take one.
    gated = backend_for(engine.dialect).write_gate(engine.url) is not None
    return ConnectionNeeds(
        transactional=(1 if gated else concurrency) if transactional else 0,
        claims=concurrency if isinstance(queue.strategy, AdvisoryLockStrategy) else 0,
        # An async engine's listener connects through an engine of its own
        # (`sa_taskqueue.core.notify.listening_engine`), outside this pool.
        listener=1 if listen and can_listen(engine) and not engine.dialect.is_async else 0,
        kept=kept,
    )


def check_pool(queue: WorkerQueue, concurrency: int, *, listen: bool) -> bool:
    """Refuse a pool too small for this worker (`PoolTooSmall`); return whether it may LISTEN.

    ``listen`` is whether the worker would (asked for, and not a burst).
    The rule, and the count, are this module's docstring.
    """
    capacity = pool_capacity(queue.engine.pool)
    if capacity is None:
        return listen
    try:
        needs = connection_needs(queue, concurrency, listen=listen)
    except DatabaseUnavailable as error:
        # The strategy is chosen from the server, which is away: the worker
        # rides the outage out, as it would without this check.
        logger.warning("could not check the engine's pool against this worker (%s): starting anyway", error)
        return listen
    if needs.total <= capacity:
        return listen
    polling = connection_needs(queue, concurrency, listen=False)
    if polling.total <= capacity:
        logger.warning(
            "the engine's pool lends %d connection(s), and listening would hold one of them for good: "
            "this worker polls every poll_interval instead of waiting on LISTEN. "
            "A pool of %d (pool_size + max_overflow) lets it listen",
            capacity,
            smallest_pool(queue, concurrency, listen=True),
        )
        return False
    raise PoolTooSmall(_too_small(queue, concurrency, capacity, needs))


def smallest_pool(queue: WorkerQueue, concurrency: int, *, listen: bool) -> int:
    """The fewest connections (``pool_size + max_overflow``) a pool needs for this worker."""
    for capacity in range(1, _LARGEST_POOL):
        if connection_needs(queue, concurrency, listen=listen, pool=_pool_of(capacity)).total <= capacity:
            return capacity
    return _LARGEST_POOL


def _largest_concurrency(queue: WorkerQueue, concurrency: int, capacity: int, *, listen: bool) -> int:
    """The most slots (up to ``concurrency``; 0 if not one) the engine's pool of ``capacity`` serves."""
    for fewer in range(concurrency, 0, -1):
        if connection_needs(queue, fewer, listen=listen).total <= capacity:
            return fewer
    return 0


def _pool_of(capacity: int) -> Pool:
    """A pool of ``capacity`` connections, never connected: asked how many the strategy would keep."""
    return QueuePool(_never_connects, pool_size=capacity, max_overflow=0)


def _never_connects() -> DBAPIConnection:
    raise AssertionError("a pool made only to be counted was asked for a connection")


def _too_small(queue: WorkerQueue, concurrency: int, capacity: int, needs: ConnectionNeeds) -> str:
    pool = queue.engine.pool
    size = pool.size() if isinstance(pool, QueuePool) else capacity
    overflow = capacity - size
    listen = needs.listener > 0
    enough = smallest_pool(queue, concurrency, listen=listen)
    fits = _largest_concurrency(queue, concurrency, capacity, listen=listen)
    fix = (
        f"give the engine at least {enough} connections: pool_size + max_overflow >= {enough}, "
        f"e.g. create_engine(..., pool_size={enough - overflow}, max_overflow={overflow})"
    )
    fix += (
        f", or run the worker with concurrency={fits} (--concurrency {fits})"
        if fits
        else " (even a concurrency of 1 needs more than this pool has)"
    )
    return (
        f"the engine's pool lends {capacity} connection(s) at once (pool_size={size}, "
        f"max_overflow={overflow}), and this worker of concurrency {concurrency} holds "
        f"{needs.total} at once: "
        f"{needs.parts()}. Its lease renewals would wait behind its tasks for a connection, and its "
        f"watchdog would kill it. Fix: {fix}"
    )


__all__ = [
    "ConnectionNeeds",
    "PoolTooSmall",
    "check_pool",
    "connection_needs",
    "pool_capacity",
    "smallest_pool",
]
