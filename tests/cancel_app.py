"""A worker process for the cancellation tests: ``python -m tests.cancel_app --url URL ...``.

Its tasks record what they did in ``test_execution`` (`tests.app.Execution`),
each line in a transaction of its own, so a test reads from the database
when a task started and what it saw; the transactional one writes its line
in its own transaction, which a cancel must roll back.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from tests.app import Execution, make_engine

#: Lines the tasks write in ``Execution.note``.
STARTED = "started"
SAW_CANCEL = "saw-cancel"
WRITTEN = "written-in-txn"


def note(engine: sa.Engine, key: int, what: str) -> None:
    with Session(engine) as session:
        session.add(Execution(task_key=key, pid=os.getpid(), note=what))
        session.commit()


def make_cancel_queue(
    engine: sa.Engine,
    lease: timedelta,
    clock: Callable[[], datetime] = utcnow,
    *,
    transactional: bool = True,
    strategy: str | None = None,
) -> tq.TaskQueue:
    """The tasks below; ``transactional=False`` leaves out the transactional one (for process isolation).

    ``strategy``: a strategy's name, else the backend's default.
    """
    queue = tq.TaskQueue(engine, lease=lease, clock=clock, strategy=strategy)

    @queue.task(name="loop_sync")
    def loop_sync(key: int) -> None:
        note(engine, key, STARTED)
        while True:
            tq.current_task().raise_if_cancelled()
            time.sleep(0.02)

    @queue.task(name="loop_async")
    async def loop_async(key: int) -> None:
        await asyncio.to_thread(note, engine, key, STARTED)
        try:
            while True:
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            await asyncio.to_thread(note, engine, key, SAW_CANCEL)
            raise

    @queue.task(name="ignore_cancel")
    def ignore_cancel(key: int) -> None:
        note(engine, key, STARTED)
        while True:
            try:
                time.sleep(3600)
            except tq.CancellationRequested:
                note(engine, key, SAW_CANCEL)  # ... and runs on: only the kill stops it

    @queue.task(name="stop_when_cancelled")
    def stop_when_cancelled(key: int) -> str:
        note(engine, key, STARTED)
        while not tq.current_task().cancel_requested:
            time.sleep(0.02)
        return "stopped of its own accord"

    def write_then_loop(session: Session, key: int) -> None:
        session.add(Execution(task_key=key, pid=os.getpid(), note=WRITTEN))
        session.flush()
        note(engine, key, STARTED)
        while True:
            tq.current_task().raise_if_cancelled()
            time.sleep(0.02)

    if transactional:
        queue.task(name="write_then_loop", transactional=True)(write_then_loop)

    @queue.task(name="nap")
    def nap(key: int, seconds: float) -> int:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            tq.current_task().raise_if_cancelled()
            time.sleep(0.005)
        return key

    @queue.task(name="report")
    def report(key: int, steps: int) -> int:
        for step in range(1, steps + 1):
            tq.current_task().report(step / steps, note={"step": step})
            time.sleep(0.01)
        note(engine, key, STARTED)  # (reports over: the test reads the last one back)
        while not tq.current_task().cancel_requested:
            time.sleep(0.02)
        return key

    return queue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--lease", type=float, default=4.0)
    parser.add_argument("--isolation", default="thread")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cancel-grace", type=float, default=10.0)
    parser.add_argument("--no-listen", action="store_true")
    args = parser.parse_args()
    engine = make_engine(args.url)
    queue = make_cancel_queue(
        engine, timedelta(seconds=args.lease), transactional=args.isolation != "process"
    )
    options: dict[str, Any] = {
        "concurrency": args.concurrency,
        "isolation": args.isolation,
        "cancel_grace": args.cancel_grace,
        "poll_interval": 0.1,
        "listen": not args.no_listen,
        "shutdown_timeout": 2.0,
    }
    tq.Worker(queue, **options).run()
    queue.close()


if __name__ == "__main__":
    main()
