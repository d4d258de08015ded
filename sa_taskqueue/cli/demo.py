"""The demo: a few hundred tasks drained by several worker processes on a SQLite file.

It uses tables of its own (``sa_taskqueue_demo_task`` and ``sa_taskqueue_demo_run``),
so pointing it at a real database never touches the application's queue.
Each task records its run in its own transaction; the summary counts those
records to show every task ran exactly once.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from sa_taskqueue.backends import local_file_url
from sa_taskqueue.cli.preflight import engine_for_url
from sa_taskqueue.core.model import TaskMixin, TaskStatus
from sa_taskqueue.queue import TaskQueue

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

DEFAULT_URL = local_file_url("sa_taskqueue_demo.db")


class DemoBase(DeclarativeBase):
    pass


class DemoTask(TaskMixin, DemoBase):
    __tablename__ = "sa_taskqueue_demo_task"


class DemoRun(DemoBase):
    """One execution of a demo task, written by the task itself."""

    __tablename__ = "sa_taskqueue_demo_run"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    task_n: Mapped[int]
    worker_pid: Mapped[int]


def demo_queue(engine: sa.Engine | AsyncEngine) -> TaskQueue:
    """The demo's queue, with its one task registered.

    Every database call of the demo goes through the queue's ``run_sync``,
    so an asyncio driver's URL works as a synchronous one does.
    """
    queue = TaskQueue(engine, model=DemoTask, lease=timedelta(seconds=30))

    @queue.task(name="demo.square")
    def square(n: int) -> int:
        queue.run_sync(lambda: _record_run(queue.engine, n))
        return n * n

    return queue


def _record_run(engine: sa.Engine, n: int) -> None:
    with Session(engine) as session:
        session.add(DemoRun(task_n=n, worker_pid=os.getpid()))
        session.commit()


def _close(queue: TaskQueue) -> None:
    queue.close()
    queue.run_sync(queue.engine.dispose)


def _worker_process(url: str) -> None:
    queue = demo_queue(engine_for_url(url))
    queue.run_worker(concurrency=2, burst=True, poll_interval=0.05)
    _close(queue)


@dataclass
class DemoSummary:
    tasks: int
    workers: int
    seconds: float
    runs_per_task: Counter[int]
    runs_per_worker: Counter[int]
    statuses: Counter[str]

    @property
    def exactly_once(self) -> bool:
        return set(self.runs_per_task) == set(range(self.tasks)) and set(self.runs_per_task.values()) == {1}


def run_demo(
    url: str, tasks: int, workers: int, progress: Callable[[int], None] | None = None
) -> DemoSummary:
    """Create the demo tables, enqueue ``tasks`` tasks, drain them with ``workers`` processes."""
    queue = demo_queue(engine_for_url(url))
    queue.run_sync(lambda: _fill(queue, tasks))
    queue.strategy  # noqa: B018 - resolve (and set up SQLite's WAL) before the workers start
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_worker_process, args=(url,)) for _ in range(workers)]
    started = time.perf_counter()
    for process in processes:
        process.start()
    while any(process.is_alive() for process in processes):
        if progress is not None:
            progress(queue.run_sync(lambda: _count_runs(queue.engine)))
        time.sleep(0.2)
    seconds = time.perf_counter() - started
    for process in processes:
        process.join()
    if progress is not None:
        progress(queue.run_sync(lambda: _count_runs(queue.engine)))
    runs, statuses = queue.run_sync(lambda: _outcome(queue.engine))
    _close(queue)
    return DemoSummary(
        tasks=tasks,
        workers=workers,
        seconds=seconds,
        runs_per_task=Counter(n for n, _ in runs),
        runs_per_worker=Counter(pid for _, pid in runs),
        statuses=Counter({TaskStatus(status).value: count for status, count in statuses}),
    )


def _fill(queue: TaskQueue, tasks: int) -> None:
    """The demo's tables made afresh, and ``tasks`` tasks in them."""
    DemoBase.metadata.drop_all(queue.engine)
    DemoBase.metadata.create_all(queue.engine)
    with Session(queue.engine) as session:
        queue.enqueue_many(session, "demo.square", ({"n": n} for n in range(tasks)))
        session.commit()


def _outcome(engine: sa.Engine) -> tuple[list[Any], list[Any]]:
    """Each run (task, worker pid), and each status's count."""
    with engine.connect() as conn:
        runs = list(conn.execute(sa.select(DemoRun.task_n, DemoRun.worker_pid)).all())
        counts = sa.select(DemoTask.status, sa.func.count()).group_by(DemoTask.status)
        return runs, list(conn.execute(counts).all())


def _count_runs(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.scalar(sa.select(sa.func.count()).select_from(DemoRun)) or 0
