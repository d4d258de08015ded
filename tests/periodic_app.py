"""Periodic tasks of the tests: the race's ticking processes, and ``tests.periodic_app:cli_queue``.

``cli_queue`` is built on first access from $SA_TASKQUEUE_DATABASE_URL, for the
command line (``worker``, ``schedules``); the race's processes build their own
queue on a clock each moves to the time it is told.
"""

from __future__ import annotations

import os
import traceback
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import Execution, make_engine, queue_bind

#: Slots every five minutes, the same instants as an interval and as a cron expression in Paris.
EVERY_5 = "every_5"
CRON_5 = "cron_5_paris"


def register_five_minutes(queue: tq.TaskQueue) -> None:
    @queue.periodic(every=timedelta(minutes=5), name=EVERY_5)
    def every_5() -> None:
        pass

    @queue.periodic("*/5 * * * *", tz="Europe/Paris", name=CRON_5, params={"note": "cron"})
    def cron_5(note: str) -> str:
        return note


def tick_rounds(url: str, times: list[str], barrier: Any, results: Any) -> None:
    """One racing process: at each time, wait for every process, then tick; report what this one enqueued.

    Reports ``(pid, enqueued, error)``; an error breaks the barrier, so that
    the other processes stop at once instead of waiting for this one.
    """
    mine: list[tuple[int, str, str]] = []
    try:
        now = [datetime.fromisoformat(times[0])]
        queue = tq.TaskQueue(queue_bind(make_engine(url)), clock=lambda: now[0])
        register_five_minutes(queue)
        queue.strategy  # noqa: B018 - connected before the first round starts
        for index, when in enumerate(times):
            now[0] = datetime.fromisoformat(when)
            barrier.wait(timeout=60)
            mine.extend((index, done.name, done.slot.isoformat()) for done in queue.enqueue_due_schedules())
        queue.close()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        barrier.abort()
        results.put((os.getpid(), mine, "".join(traceback.format_exception(error))))
        return
    results.put((os.getpid(), mine, None))


def _make_cli_queue() -> tq.TaskQueue:
    engine = make_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"])
    queue = tq.TaskQueue(queue_bind(engine))

    @queue.periodic(every=timedelta(seconds=1), name="tick_every_second", params={"key": 1})
    def tick_every_second(key: int) -> None:
        with Session(engine) as session:
            session.add(Execution(task_key=key, pid=os.getpid(), note="periodic"))
            session.commit()

    @queue.periodic("30 2 * * *", tz="Europe/Paris", name="nightly_paris", params={"key": 2})
    def nightly(key: int) -> None:
        pass

    return queue


_cli_queue: list[tq.TaskQueue] = []


def __getattr__(name: str) -> Any:
    if name == "cli_queue":
        if not _cli_queue:
            _cli_queue.append(_make_cli_queue())
        return _cli_queue[0]
    raise AttributeError(name)


def executions(engine: sa.Engine) -> list[Execution]:
    with Session(engine) as session:
        return list(session.scalars(sa.select(Execution).where(Execution.note == "periodic")))


__all__ = ["CRON_5", "EVERY_5", "executions", "register_five_minutes", "tick_rounds"]
