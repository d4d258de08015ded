"""An application whose only engine is async, run by the command line: ``tests.async_cli_app:queue``.

Configured from the environment the test sets for the subprocess: the
database URL (sync form, as the suite's backends give it) and the async driver.
"""

from __future__ import annotations

import asyncio
import os

from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

import sa_taskqueue as tq
from tests.app import Execution
from tests.backends import async_url

engine = create_async_engine(
    async_url(os.environ["SA_TASKQUEUE_DATABASE_URL"], os.environ["SA_TASKQUEUE_TEST_ASYNC_DRIVER"])
)
queue = tq.TaskQueue(engine)


@queue.task(name="double")
def double(n: int) -> int:
    return 2 * n


@queue.task(name="arecord")
async def arecord(key: int) -> int:
    """Writes through the application's own async engine, on the loop the worker runs it on."""
    await asyncio.sleep(0)
    async with AsyncSession(engine) as session:
        session.add(Execution(task_key=key, pid=os.getpid()))
        await session.commit()
    return key
