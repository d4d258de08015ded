"""A test application with transactional tasks, and its worker process for the kill storm.

Each task inserts one row into ``test_txn_effect`` through the session the
worker gives it.  The table has no unique constraint on the task's key, so a
task whose writes committed twice shows as two rows.  Run as
``python -m tests.txn_app ...`` it is one worker process of the storm.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from tests.app import make_engine, queue_bind


class TxnBase(DeclarativeBase):
    pass


class Effect(TxnBase):
    """One write of a transactional task: exactly one per task when all is well."""

    __tablename__ = "test_txn_effect"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    task_key: Mapped[int] = mapped_column(index=True)  # deliberately not unique


def reset(engine: sa.Engine) -> None:
    TxnBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(Effect.__table__.delete())


def effects(engine: sa.Engine) -> dict[int, int]:
    """task_key -> how many effect rows it has."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(Effect.task_key, sa.func.count()).group_by(Effect.task_key)).all()
    return dict(rows)  # type: ignore[arg-type]


class Gate:
    """Where a test holds a task: ``wait`` blocks until ``open``."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.opened = threading.Event()

    def wait(self) -> None:
        self.reached.set()
        if not self.opened.wait(60):
            raise TimeoutError("the test never opened the gate")


def make_txn_queue(
    engine: sa.Engine,
    strategy: str | None,
    lease: timedelta,
    clock: Callable[[], datetime] = utcnow,
    *,
    bind: Any = None,
) -> tq.TaskQueue:
    """A queue with transactional ``effect`` (one row, maybe a pause, maybe a raise) and ``effect_slow``.

    On an async engine (``--async-driver``) the tasks are ``async def`` and get
    an AsyncSession; on a sync one, plain ``def`` getting a Session.
    """
    queue = tq.TaskQueue(
        queue_bind(engine) if bind is None else bind, strategy=strategy, lease=lease, clock=clock
    )
    fast_retry = timedelta(milliseconds=1)
    if queue.is_async:

        @queue.task(name="effect", transactional=True, retry_delay=fast_retry)
        async def effect_async(
            session: Any, key: int, fail: bool = False, commit: bool = False, pause: float = 0.0
        ) -> int:
            session.add(Effect(task_key=key))
            await (session.commit() if commit else session.flush())
            if pause:
                await asyncio.sleep(pause)  # inside the transaction, its insert made
            if fail:
                raise RuntimeError(f"task {key} failed after writing")
            return key

        @queue.task(name="effect_slow", transactional=True, timeout=0.2)
        async def effect_slow_async(session: Any, key: int) -> int:
            session.add(Effect(task_key=key))
            await session.flush()
            await asyncio.sleep(0.4)
            return key

    else:

        @queue.task(name="effect", transactional=True, retry_delay=fast_retry)
        def effect(
            session: Session, key: int, fail: bool = False, commit: bool = False, pause: float = 0.0
        ) -> int:
            session.add(Effect(task_key=key))
            session.commit() if commit else session.flush()
            if pause:
                time.sleep(pause)  # inside the transaction, its insert made
            if fail:
                raise RuntimeError(f"task {key} failed after writing")
            return key

        @queue.task(name="effect_slow", transactional=True, timeout=0.2)
        def effect_slow(session: Session, key: int) -> int:
            session.add(Effect(task_key=key))
            session.flush()
            time.sleep(0.4)
            return key

    return queue


def _work(args: argparse.Namespace) -> None:
    """One storm worker: runs ``effect`` tasks until killed (or stopped with SIGTERM)."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    engine = make_engine(args.url)
    # On the test run's async driver, if any (the variable is inherited): async def tasks then.
    queue = make_txn_queue(engine, None, timedelta(seconds=args.lease))
    # The watchdog would kill a stopped worker before its lease ends; without
    # it a stopped worker wakes up after another took its tasks, and only the
    # fence stands between it and a second commit of their writes.
    queue.run_worker(concurrency=args.concurrency, poll_interval=0.05, watchdog=args.watchdog, listen=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--lease", type=float, default=1.5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--name", default="worker")
    parser.add_argument("--watchdog", action="store_true", help="run watched, as workers are by default")
    _work(parser.parse_args())


if __name__ == "__main__":
    main()
