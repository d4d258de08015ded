"""FastAPI (and any ASGI app with a lifespan): a worker in the app's event loop, a transaction per request.

A queue on an `AsyncEngine` runs its worker as a task of the running loop
(``await queue.run_worker_async(...)``).  The app's lifespan starts it and
must stop it, and a worker that died meanwhile should not go unnoticed:
`running_worker` does both, `worker_lifespan` is it as a whole lifespan.

FastAPI ends a ``yield`` dependency after the response has been sent unless
it is declared with ``scope="function"``.  A session that committed there
would tell the client "created" before the commit, and a commit that failed
would never reach it.  `session_dependency` commits when the endpoint
returns, before the response, and rolls back when it raises::

    engine = create_async_engine(url)
    Session = async_sessionmaker(engine)
    queue = tq.TaskQueue(engine)
    DbSession = Annotated[AsyncSession, session_dependency(Session)]
    app = FastAPI(lifespan=worker_lifespan(queue, concurrency=4))

    @app.post("/orders", status_code=201)
    async def create_order(session: DbSession) -> dict[str, int]:
        order = Order(...)
        session.add(order)
        await session.flush()
        await send_confirmation.enqueue(session, order_id=order.id)
        return {"id": order.id}          # committed, task and order, before this is sent

Needs the ``fastapi`` extra (``pip install 'sa_taskqueue[fastapi]'``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import Depends, params
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sa_taskqueue.queue import TaskQueue

logger = logging.getLogger("sa_taskqueue")


@asynccontextmanager
async def running_worker(queue: TaskQueue, **options: Any) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``queue.run_worker_async(**options)`` in the running loop while the block runs.

    Leaving the block cancels the worker, which stops claiming and finishes
    or gives back what it runs (see `TaskQueue.run_worker_async`), and waits
    for it.  A worker that stopped by itself with an error is logged at once
    and its error raised on leaving, so a lifespan ends with it instead of
    serving requests whose tasks nobody runs unnoticed.  Yields the worker's
    `asyncio.Task`.
    """
    worker = asyncio.create_task(queue.run_worker_async(**options), name="sa_taskqueue worker")
    worker.add_done_callback(_log_early_end)
    try:
        yield worker
    finally:
        worker.remove_done_callback(_log_early_end)
        worker.cancel()
        # Wait for the worker's own shutdown.  gather() with return_exceptions
        # keeps the worker's CancelledError from looking like ours; a
        # cancellation of this task itself still raises here.
        await asyncio.gather(worker, return_exceptions=True)
    error = None if worker.cancelled() else worker.exception()
    if error is not None:
        raise error


def _log_early_end(worker: asyncio.Task[Any]) -> None:
    if worker.cancelled():
        return
    error = worker.exception()
    if error is not None:
        logger.error("the worker stopped with an error: %s", error, exc_info=error)


def worker_lifespan(queue: TaskQueue, **options: Any) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A lifespan for ``FastAPI(lifespan=...)`` that runs a worker while the app runs.

    ``options`` are `TaskQueue.run_worker_async`'s (``concurrency``,
    ``queues``, ``poll_interval``, ...).  An app with more to do at startup
    uses `running_worker` inside its own lifespan instead.
    """

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        async with running_worker(queue, **options):
            yield

    return lifespan


def session_dependency(sessionmaker: async_sessionmaker[AsyncSession]) -> params.Depends:
    """A dependency giving each request a session in a transaction that ends before the response.

    The transaction commits when the endpoint returns and rolls back when it
    raises (an `HTTPException` included), so what the endpoint enqueued
    exists exactly when the client is told it succeeded.  Use it as
    ``Annotated[AsyncSession, session_dependency(Session)]``.
    """
    if not isinstance(sessionmaker, async_sessionmaker):
        raise TypeError(
            f"session_dependency takes an sqlalchemy.ext.asyncio.async_sessionmaker, got {sessionmaker!r}"
        )

    async def session_in_transaction() -> AsyncIterator[AsyncSession]:
        async with sessionmaker() as session, session.begin():
            yield session

    # scope="function": end it (commit) when the endpoint returns, not after the response is sent.
    return Depends(session_in_transaction, scope="function")  # type: ignore[no-any-return]


__all__ = ["running_worker", "session_dependency", "worker_lifespan"]
