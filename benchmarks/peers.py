"""Worker against worker: sa_taskqueue, Procrastinate and PgQueuer on one PostgreSQL server, in one run.

Each peer gets a database of its own, created for the run and dropped after
it, with its schema installed by its own tooling.  Each implementation runs W
worker processes, each started and connected before the clock starts, running
until the queue is empty, configured as its documentation says for throughput:

- sa_taskqueue: ``run_worker(concurrency=B, burst=True)``: B task slots,
  whose free ones each claim fills.
- sa_taskqueue async: the same through an AsyncEngine (asyncpg) and
  ``await run_worker_async(concurrency=B, burst=True)``, ``async def`` no-op
  tasks run on the worker's event loop.
- Procrastinate: ``run_worker(wait=False)`` (stop once caught up), one job at
  a time per worker (its ``concurrency`` is for async tasks; ours is sync).
- PgQueuer: asyncpg, ``mode=drain``, ``batch_size`` = B.

The no-op task records its argument in the worker, so "exactly once" is
checked here from what ran, as for sa_taskqueue.  A run's time is from the
start signal to the last task's run.

Needs ``pip install -e '.[bench-peers]'``; without it the section says so and
is left out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import async_url, fresh_table
from benchmarks.clients import LEASE, async_noop, noop
from benchmarks.drain import DrainResult, seed, start_together

PEERS = ("procrastinate", "pgqueuer")
IMPLEMENTATIONS = ("sa_taskqueue", "sa_taskqueue_async", *PEERS)


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
    results.put((ran, stamps[-1] if stamps else 0.0))


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
    results.put((ran, stamps[-1] if stamps else 0.0))


# sa_taskqueue's own Worker ------------------------------------------------------------


def _sa_taskqueue_seed(url: str, tasks: int) -> None:
    fresh_table(url)
    seed(url, tasks)


def _sa_taskqueue_worker(url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    import sa_taskqueue as tq

    ran: list[int] = []
    stamps: list[float] = []

    def record(task: tq.ClaimedTask, _result: object) -> None:
        ran.append(task.id)
        stamps.append(time.perf_counter())

    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine, lease=LEASE)
    queue.task(name="noop")(noop)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05, on_success=record)
    queue.close()
    engine.dispose()
    results.put((ran, stamps[-1] if stamps else 0.0))


def _sa_taskqueue_async_worker(url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    import sa_taskqueue as tq

    ran: list[int] = []
    stamps: list[float] = []

    def record(task: tq.ClaimedTask, _result: object) -> None:
        ran.append(task.id)
        stamps.append(time.perf_counter())

    engine = create_async_engine(async_url(url, "asyncpg"))
    queue = tq.TaskQueue(engine, lease=LEASE)
    queue.task(name="noop")(async_noop)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()

    async def serve() -> None:
        await queue.run_worker_async(concurrency=batch, burst=True, poll_interval=0.05, on_success=record)
        await asyncio.to_thread(queue.close)
        await engine.dispose()

    asyncio.run(serve())
    results.put((ran, stamps[-1] if stamps else 0.0))


SEED = {
    "sa_taskqueue": _sa_taskqueue_seed,
    "sa_taskqueue_async": _sa_taskqueue_seed,
    "procrastinate": _procrastinate_seed,
    "pgqueuer": _pgqueuer_seed,
}
WORKER = {
    "sa_taskqueue": _sa_taskqueue_worker,
    "sa_taskqueue_async": _sa_taskqueue_async_worker,
    "procrastinate": _procrastinate_worker,
    "pgqueuer": _pgqueuer_worker,
}


def worker_drain(implementation: str, url: str, tasks: int, workers: int, batch: int) -> DrainResult:
    """One run: ``tasks`` no-op jobs, ``workers`` worker processes of ``implementation`` draining them.

    A peer gets a fresh database of its own; sa_taskqueue a fresh table in ``url``'s.
    """
    if implementation.startswith("sa_taskqueue"):
        return _race(implementation, url, tasks, workers, batch)
    with scratch_database(url, f"{sa.make_url(url).database}_{implementation}") as dsn:
        return _race(implementation, dsn, tasks, workers, batch)


def _race(implementation: str, dsn: str, tasks: int, workers: int, batch: int) -> DrainResult:
    SEED[implementation](dsn, tasks)
    started, outcomes = start_together(WORKER[implementation], (dsn, batch), workers)
    done = [n for ran, _ in outcomes for n in ran]
    finished = max(last for _, last in outcomes)
    return DrainResult(
        seconds=max(finished - started, 1e-9),
        tasks=len(done),
        exactly_once=len(done) == tasks and len(set(done)) == tasks,
    )
