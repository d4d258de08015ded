"""sa_taskqueue.integrations.fastapi's worker in the app's event loop, on the backend under test.

`running_worker` must run tasks while its block runs, stop the worker when
the block ends, and not let a worker that failed go unnoticed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.integrations.fastapi import running_worker
from tests.async_drivers import async_url
from tests.backends import Backend

# Visit keeps a plain integer primary key, as an app's model would; Oracle needs an Identity for it
# to number itself, so this is not run there.
pytestmark = pytest.mark.backends("sqlite", "postgres", "mysql", "mariadb")


class WorkerBase(DeclarativeBase):
    pass


class Visit(WorkerBase):
    """One run of the test's task, written by the task itself."""

    __tablename__ = "fastapi_worker_visit"

    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[int]


class WorkerJob(tq.TaskMixin, WorkerBase):
    __tablename__ = "fastapi_worker_job"


@pytest.fixture
def database(backend: Backend, tmp_path: Path) -> Iterator[sa.Engine]:
    """A plain engine on the backend, with the test's tables empty."""
    url = f"sqlite:///{tmp_path / 'worker.db'}" if backend.is_sqlite else backend.url
    engine = sa.create_engine(url)
    WorkerBase.metadata.drop_all(engine)
    WorkerBase.metadata.create_all(engine)
    yield engine
    WorkerBase.metadata.drop_all(engine)
    engine.dispose()


def test_the_worker_runs_tasks_while_the_block_runs_and_stops_with_it(database: sa.Engine) -> None:
    async def scenario() -> bool:
        engine = create_async_engine(async_url(database.url.render_as_string(hide_password=False)))
        sessions = async_sessionmaker(engine)
        queue = tq.TaskQueue(engine, model=WorkerJob)
        ran = asyncio.Event()

        @queue.task(name="visit")
        async def visit(key: int) -> None:
            async with sessions() as session, session.begin():
                session.add(Visit(key=key))
            ran.set()

        try:
            async with running_worker(queue, poll_interval=0.05) as worker:
                async with sessions() as session, session.begin():
                    await visit.enqueue(session, key=7)
                await asyncio.wait_for(ran.wait(), 30)
            return worker.done()
        finally:
            await engine.dispose()

    assert asyncio.run(scenario())  # the worker had stopped when the block was left
    with Session(database) as session:
        assert list(session.scalars(sa.select(Visit.key))) == [7]
        [job] = session.scalars(sa.select(WorkerJob))
        assert (job.status, job.attempts) == (tq.TaskStatus.COMPLETED, 1)


def test_a_worker_that_fails_is_logged_and_raised_on_leaving(
    database: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        engine = create_async_engine(async_url(database.url.render_as_string(hide_password=False)))
        queue = tq.TaskQueue(engine, model=WorkerJob)
        try:
            async with running_worker(queue, concurrency=0) as worker:
                await asyncio.wait({worker}, timeout=30)  # it stops by itself, at once
                assert worker.done()
        finally:
            await engine.dispose()

    with (
        caplog.at_level(logging.ERROR, logger="sa_taskqueue"),
        pytest.raises(ValueError, match="concurrency"),
    ):
        asyncio.run(scenario())
    assert "the worker stopped with an error" in caplog.text
