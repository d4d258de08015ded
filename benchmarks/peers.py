"""Worker against worker on one PostgreSQL server: sa_taskqueue, a raw asyncpg loop, Procrastinate, PgQueuer.

Each peer gets a database of its own, created for the run and dropped after
it, with its schema installed by its own tooling.  Each implementation runs W
worker processes, each started and connected before the clock starts, running
until the queue is empty, configured as its documentation says for throughput:

- sa_taskqueue: ``run_worker(concurrency=B, burst=True)``: B task slots,
  whose free ones each claim fills, no hooks (as ``sa-taskqueue worker``
  runs).
- sa_taskqueue async: the same through an AsyncEngine (asyncpg) and
  ``await run_worker_async(concurrency=B, burst=True)``, ``async def`` no-op
  tasks run on the worker's event loop.
- raw asyncpg: the raw psycopg drain loop of ``benchmarks.clients`` on
  asyncpg, with no SQLAlchemy, on the same table and rows as sa_taskqueue:
  the floor under sa_taskqueue async's figure, as the raw driver is under
  the drain table's.
- Procrastinate: ``run_worker(wait=False)`` (stop once caught up), one job at
  a time per worker (its ``concurrency`` is for async tasks; ours is sync).
- PgQueuer: asyncpg, ``mode=drain``, ``batch_size`` = B.

The no-op task records its argument in the worker, so "exactly once" is
checked here from what ran; on sa_taskqueue's table every row must also end
completed.  A run's time is from the start signal to the last task's run.

Needs ``pip install -e '.[bench-peers]'``; without it the section says so and
is left out.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import async_url, fresh_table
from benchmarks.clients import LEASE, PostgresClient, _worker_id, async_noop
from benchmarks.drain import DrainResult, seed, start_together

PEERS = ("procrastinate", "pgqueuer")
#: Run on sa_taskqueue's own table in the benchmark database, seeded alike.
ON_OUR_TABLE = ("sa_taskqueue", "sa_taskqueue_async", "raw_asyncpg")
IMPLEMENTATIONS = (*ON_OUR_TABLE, *PEERS)


def missing_peers() -> list[str]:
    """The peers whose package is not installed."""
    import importlib.util

    return [peer for peer in PEERS if importlib.util.find_spec(peer) is None]


@contextmanager
def scratch_database(url: str, name: str) -> Iterator[str]:
    """A new database next to ``url``'s, as a libpq conninfo URL; dropped afterwards."""
    admin = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    target = sa.make_url(url).set(database=name, drivername="postgresql")
    try:
        yield target.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


# Procrastinate ------------------------------------------------------------------


def _procrastinate_app(dsn: str, ran: list[int] | None = None) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")
    def noop(n: int) -> None:
        if ran is not None:
            ran.append(n)

    return app


def _procrastinate_seed(dsn: str, tasks: int) -> None:
    app = _procrastinate_app(dsn)
    with app.open():
        app.schema_manager.apply_schema()
        noop = app.tasks["noop"]
        for start in range(0, tasks, 1000):
            noop.batch_defer(*({"n": n} for n in range(start, min(start + 1000, tasks))))


def _procrastinate_worker(dsn: str, _batch: int, ready: Any, go: Any, results: Any) -> None:
    ran: list[int] = []
    stamps: list[float] = []
    app = _procrastinate_app(dsn, ran)

    async def work() -> None:
        async with app.open_async():
            ready.release()
            await asyncio.get_running_loop().run_in_executor(None, go.wait)
            await app.run_worker_async(wait=False, concurrency=1, install_signal_handlers=False)

    original = app.tasks["noop"].func

    def timed(n: int) -> None:
        original(n)
        stamps.append(time.perf_counter())

    app.tasks["noop"].func = timed
    asyncio.run(work())
    results.put((ran, max(stamps, default=0.0)))


# PgQueuer -------------------------------------------------------------------------


async def _pgqueuer_queries(dsn: str) -> Any:
    import asyncpg
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    return Queries(AsyncpgDriver(await asyncpg.connect(dsn)))


def _pgqueuer_seed(dsn: str, tasks: int) -> None:
    async def seed() -> None:
        queries = await _pgqueuer_queries(dsn)
        await queries.install()
        for start in range(0, tasks, 1000):
            count = min(start + 1000, tasks) - start
            payloads = [str(n).encode() for n in range(start, start + count)]
            await queries.enqueue(["noop"] * count, payloads, [0] * count)

    asyncio.run(seed())


def _pgqueuer_worker(dsn: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    from pgqueuer.qm import QueueManager
    from pgqueuer.types import QueueExecutionMode

    ran: list[int] = []
    stamps: list[float] = []

    async def work() -> None:
        manager = QueueManager(await _pgqueuer_queries(dsn))

        @manager.entrypoint("noop")
        async def noop(job: Any) -> None:
            ran.append(int(job.payload))
            stamps.append(time.perf_counter())

        ready.release()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        await manager.run(batch_size=batch, mode=QueueExecutionMode.drain)

    asyncio.run(work())
    results.put((ran, max(stamps, default=0.0)))


# sa_taskqueue's own Worker ------------------------------------------------------------


def _sa_taskqueue_seed(url: str, tasks: int) -> None:
    fresh_table(url)
    seed(url, tasks, numbered=True)


def _not_completed(url: str) -> int:
    """Rows of sa_taskqueue's table that a drain left in any status but completed."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    table = tq.Task.__table__
    with engine.connect() as conn:
        left = conn.scalar(
            sa.select(sa.func.count()).select_from(table).where(table.c.status != tq.TaskStatus.COMPLETED)
        )
    engine.dispose()
    return int(left or 0)


def _sa_taskqueue_worker(url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    import sa_taskqueue as tq

    ran: list[int] = []
    stamps: list[float] = []

    def numbered_noop(n: int) -> None:
        ran.append(n)
        stamps.append(time.perf_counter())

    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine, lease=LEASE)
    queue.task(name="noop")(numbered_noop)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05)
    queue.close()
    engine.dispose()
    results.put((ran, max(stamps, default=0.0)))


def _sa_taskqueue_async_worker(url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    import sa_taskqueue as tq

    ran: list[int] = []
    stamps: list[float] = []

    async def numbered_noop(n: int) -> None:
        ran.append(n)
        stamps.append(time.perf_counter())

    engine = create_async_engine(async_url(url, "asyncpg"))
    queue = tq.TaskQueue(engine, lease=LEASE)
    queue.task(name="noop")(numbered_noop)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()

    async def serve() -> None:
        await queue.run_worker_async(concurrency=batch, burst=True, poll_interval=0.05)
        await asyncio.to_thread(queue.close)
        await engine.dispose()

    asyncio.run(serve())
    results.put((ran, max(stamps, default=0.0)))


# Raw asyncpg -------------------------------------------------------------------------


def _numbered(statement: str, *names: str) -> str:
    """A psycopg ``%(name)s`` statement in asyncpg's ``$n`` placeholders, so both loops send the same SQL."""
    for n, name in enumerate(names, start=1):
        statement = statement.replace(f"%({name})s", f"${n}")
    return statement


RAW_CLAIM = _numbered(PostgresClient.CLAIM, "batch", "worker")
RAW_COMPLETE = _numbered(PostgresClient.COMPLETE, "id", "worker")


def _raw_asyncpg_worker(url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    """The raw psycopg drain loop on asyncpg: claim up to ``batch``, run each, complete each, fenced.

    A task counts as run only when its fenced completion updated its row, so
    a task completed twice, or by a worker that lost it, fails the
    exactly-once check.  Its stamp is taken after that completion.
    """
    import asyncpg

    ran: list[int] = []
    stamps: list[float] = []
    dsn = sa.make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)

    async def work() -> None:
        conn = await asyncpg.connect(dsn)
        # psycopg hands params back decoded; so does this connection.
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        worker = _worker_id()
        ready.release()
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        empty = 0
        while empty < 3:
            claimed = await conn.fetch(RAW_CLAIM, batch, worker)
            if not claimed:
                empty += 1
                await asyncio.sleep(0.01)
                continue
            empty = 0
            for task_id, params in claimed:
                await async_noop(**params)
                if await conn.execute(RAW_COMPLETE, task_id, worker) == "UPDATE 1":
                    ran.append(task_id)
                    stamps.append(time.perf_counter())
        await conn.close()

    asyncio.run(work())
    results.put((ran, max(stamps, default=0.0)))


SEED = {
    "sa_taskqueue": _sa_taskqueue_seed,
    "sa_taskqueue_async": _sa_taskqueue_seed,
    "raw_asyncpg": _sa_taskqueue_seed,
    "procrastinate": _procrastinate_seed,
    "pgqueuer": _pgqueuer_seed,
}
WORKER = {
    "sa_taskqueue": _sa_taskqueue_worker,
    "sa_taskqueue_async": _sa_taskqueue_async_worker,
    "raw_asyncpg": _raw_asyncpg_worker,
    "procrastinate": _procrastinate_worker,
    "pgqueuer": _pgqueuer_worker,
}


def worker_drain(implementation: str, url: str, tasks: int, workers: int, batch: int) -> DrainResult:
    """One run: ``tasks`` no-op jobs, ``workers`` worker processes of ``implementation`` draining them.

    A peer gets a fresh database of its own; sa_taskqueue and raw asyncpg a fresh table in ``url``'s.
    """
    if implementation in ON_OUR_TABLE:
        return _race(implementation, url, tasks, workers, batch)
    with scratch_database(url, f"{sa.make_url(url).database}_{implementation}") as dsn:
        return _race(implementation, dsn, tasks, workers, batch)


def _race(implementation: str, dsn: str, tasks: int, workers: int, batch: int) -> DrainResult:
    SEED[implementation](dsn, tasks)
    # Metered in the database the run uses: a peer's own, or sa_taskqueue's.
    together = start_together(WORKER[implementation], (dsn, batch), workers, meter=dsn)
    done = [n for ran, _ in together.outcomes for n in ran]
    finished = max(last for _, last in together.outcomes)
    completed = implementation not in ON_OUR_TABLE or _not_completed(dsn) == 0
    return DrainResult(
        seconds=max(finished - together.started, 1e-9),
        tasks=len(done),
        exactly_once=completed and len(done) == tasks and len(set(done)) == tasks,
    ).with_costs(together.client_cpu, together.usage)
