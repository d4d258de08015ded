"""Bulk enqueue through an AsyncSession: on psycopg's asyncio driver the COPY runs too, in the caller's
transaction."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

import sa_taskqueue as tq
from sa_taskqueue.core.bulk_insert import COPY_THRESHOLD
from tests.backends import ASYNC_DRIVERS, Backend, async_url

pytestmark = pytest.mark.async_path

ROWS = max(3 * COPY_THRESHOLD, 1200)


def test_an_async_session_bulk_enqueues_in_order_and_in_the_callers_transaction(
    request: pytest.FixtureRequest, backend: Backend, engine: sa.Engine
) -> None:
    driver = request.config.getoption("--async-driver") or ASYNC_DRIVERS[backend.name][0]
    async_engine = create_async_engine(async_url(backend.url, driver), poolclass=NullPool)
    queue = tq.TaskQueue(async_engine)
    queue.task(name="record")(lambda key: None)
    keys = [(n * 7919) % ROWS for n in range(ROWS)]

    async def main() -> list[int] | None:
        async with AsyncSession(async_engine) as session:
            await queue.enqueue_many(session, "record", [{"key": k} for k in keys], queue="gone")
            await session.rollback()
            ids = await queue.enqueue_many(session, "record", [{"key": k} for k in keys], chunk_size=500)
            await session.commit()
        await async_engine.dispose()
        return ids

    ids = asyncio.run(main())
    with engine.connect() as conn:
        rows = conn.execute(sa.select(tq.Task.id, tq.Task.params, tq.Task.queue)).all()
    assert len(rows) == ROWS and "gone" not in {row.queue for row in rows}
    if ids is None:  # MySQL cannot return ids from a multi-row INSERT
        assert engine.dialect.name == "mysql"
        return
    by_id = {row.id: row.params["key"] for row in rows}
    assert [by_id[task_id] for task_id in ids] == keys
