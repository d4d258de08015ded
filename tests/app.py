"""A small application the tests run: its own table of executions, its tasks, and worker entry points.

Tasks record each execution in ``test_execution`` in a transaction of their
own, so "ran exactly once" is checked from what the task itself committed,
not from the queue's bookkeeping.  Run as ``python -m tests.app ...`` it is a
worker process for the race and crash tests.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import json
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.strategies import ClaimStrategy
from tests.helpers import wait_until


class AppBase(DeclarativeBase):
    pass


class Execution(AppBase):
    """One run of a task, written by the task itself."""

    __tablename__ = "test_execution"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)  # an identity on Oracle
    task_key: Mapped[int] = mapped_column(index=True)
    pid: Mapped[int]
    note: Mapped[str] = mapped_column(sa.String(50), default="")


#: Set (by ``--async-driver``) to run every queue below on an AsyncEngine of that driver.
ASYNC_DRIVER_VARIABLE = "SA_TASKQUEUE_TEST_ASYNC_DRIVER"


def make_engine(url: str) -> sa.Engine:
    return sa.create_engine(url, pool_size=10, max_overflow=20)


@functools.cache
def async_engine(url: str, driver: str) -> Any:
    """One AsyncEngine per database and driver for the whole process: queues share its loop and pool."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from tests.backends import async_url

    return create_async_engine(async_url(url, driver), pool_size=10, max_overflow=20)


def queue_bind(engine: sa.Engine) -> Any:
    """What the test application's queue is built on: ``engine``, or its async twin under --async-driver."""
    driver = os.environ.get(ASYNC_DRIVER_VARIABLE)
    if not driver:
        return engine
    return async_engine(engine.url.render_as_string(hide_password=False), driver)


def make_queue(
    engine: sa.Engine,
    strategy: str | ClaimStrategy | None,
    lease: timedelta,
    clock: Callable[[], datetime] = utcnow,
) -> tq.TaskQueue:
    """The test application's queue with its tasks registered, reading the time from ``clock``."""
    queue = tq.TaskQueue(queue_bind(engine), strategy=strategy, lease=lease, clock=clock)

    @queue.task(name="record")
    def record(key: int, sleep: float = 0.0) -> int:
        if sleep:
            time.sleep(sleep)
        with Session(engine) as session:
            session.add(Execution(task_key=key, pid=os.getpid()))
            session.commit()
        return key

    @queue.task(name="hang")
    def hang(key: int) -> None:
        record(key)  # committed: the test sees the task has started
        time.sleep(3600)

    @queue.task(name="boom", retry_delay=timedelta(milliseconds=50))
    def boom(message: str) -> None:
        raise ValueError(message)

    @queue.task(name="exit_hard")
    def exit_hard(code: int) -> None:
        os._exit(code)

    @queue.task(name="segfault")
    def segfault() -> None:
        import ctypes

        ctypes.string_at(0)

    @queue.task(name="span")
    def span(key: int, seconds: float, hold_gil: bool = False) -> None:
        """Log its start and end to $SA_TASKQUEUE_TEST_SPANS.

        Only the first run lasts ``seconds`` (holding the GIL throughout,
        with ``hold_gil``); a later run ends at once.
        """
        record_span("start", key)
        marker = Path(os.environ["SA_TASKQUEUE_TEST_SPANS"] + f".ran-{key}")
        if not marker.exists():
            marker.touch()
            if hold_gil:
                # A C call made through PyDLL keeps the GIL: no other thread
                # of this process runs until it returns, the heartbeat included.
                libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.sleep(int(seconds))
            else:
                time.sleep(seconds)
        record_span("end", key)

    @queue.task(name="slow", timeout=timedelta(seconds=0.5))
    def slow(seconds: float) -> str:
        time.sleep(seconds)
        return "finished late"

    return queue


def record_span(event: str, key: int) -> None:
    """One line per event, appended in one write (atomic for lines this short) to $SA_TASKQUEUE_TEST_SPANS."""
    line = f"{event} {key} {os.getpid()} {time.time()!r}\n".encode()
    fd = os.open(os.environ["SA_TASKQUEUE_TEST_SPANS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def executions(engine: sa.Engine) -> dict[int, int]:
    """task_key -> how many times it ran."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(Execution.task_key, sa.func.count()).group_by(Execution.task_key)).all()
    return dict(rows)  # type: ignore[arg-type]


def _queued(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).select_from(tq.Task).where(tq.Task.status == tq.TaskStatus.QUEUED)
        ).scalar_one()


def _race(args: argparse.Namespace) -> None:
    """Claim and run until no task is left queued, after the start signal; print what we ran."""
    engine = make_engine(args.url)
    queue = make_queue(engine, args.strategy, timedelta(seconds=args.lease))
    queue.strategy  # noqa: B018 - connect and resolve before the start line
    Path(args.ready).touch()
    wait_until(Path(args.go).exists, 300, "the start signal", every=0.01)
    ran = 0
    # An empty claim may only mean that rivals held the rows it looked at; we
    # are done when none is left to claim (the lease outlasts the race, so
    # no running task comes back).
    while True:
        claimed = queue.claim(limit=args.batch)
        if not claimed:
            if _queued(engine) == 0:
                break
            continue
        for task in claimed:
            registered = queue.registered(task.name)
            assert registered is not None
            result = registered.func(**task.params)
            if not queue.complete(task, result):
                raise RuntimeError(f"lost the lease of task {task.id}")
            ran += 1
    queue.close()
    print(json.dumps({"pid": os.getpid(), "ran": ran}))


def _run_one(args: argparse.Namespace) -> None:
    """Claim one task and run it (the crash test kills us in the middle)."""
    engine = make_engine(args.url)
    queue = make_queue(engine, args.strategy, timedelta(seconds=args.lease))
    claimed: list[tq.ClaimedTask] = []

    def claimed_one() -> bool:
        claimed.extend(queue.claim(limit=1))
        return bool(claimed)

    wait_until(claimed_one, 30, "a task to claim")
    task = claimed[0]
    registered = queue.registered(task.name)
    assert registered is not None
    queue.complete(task, registered.func(**task.params))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(required=True)
    race = sub.add_parser("race")
    race.add_argument("--ready", required=True)
    race.add_argument("--go", required=True)
    race.add_argument("--batch", type=int, default=1)
    race.set_defaults(run=_race)
    one = sub.add_parser("run-one")
    one.set_defaults(run=_run_one)
    for p in (race, one):
        p.add_argument("--url", required=True)
        p.add_argument("--strategy", required=True)
        p.add_argument("--lease", type=float, default=300.0)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
