"""The test application on a small connection pool, as the command line's worker imports it.

``tests.small_pool_app:queue`` is the test application's queue (tests.app) on
an engine of ``$SA_TASKQUEUE_TEST_POOL`` connections (``pool_size``, no
overflow); its ``record`` task writes through that same engine.  With
``$SA_TASKQUEUE_TEST_TRANSACTIONAL`` set, it also has the transactional
``effect``, which writes its execution in the worker's transaction.
"""

from __future__ import annotations

import os
from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

from tests.app import Execution, make_queue

engine = sa.create_engine(
    os.environ["SA_TASKQUEUE_DATABASE_URL"],
    pool_size=int(os.environ["SA_TASKQUEUE_TEST_POOL"]),
    max_overflow=0,
    pool_timeout=10,
)
queue = make_queue(engine, os.environ.get("SA_TASKQUEUE_TEST_STRATEGY") or None, timedelta(minutes=5))

if os.environ.get("SA_TASKQUEUE_TEST_TRANSACTIONAL"):

    @queue.task(name="effect", transactional=True)
    def effect(session: Session, key: int) -> int:
        session.add(Execution(task_key=key, pid=os.getpid()))
        return key
