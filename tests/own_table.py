"""An application's own task table: `TaskMixin` mapped on the application's own Base, as a user would.

The command line's ``--app`` must find this table through the queue, not
the library's ``sa_taskqueue_task``.  ``register`` gives a queue on it the
tasks the tests enqueue, each with defaults of its own.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import DeclarativeBase

import sa_taskqueue as tq


class JobBase(DeclarativeBase):
    pass


class Job(tq.TaskMixin, JobBase):
    __tablename__ = "app_job"


def register(queue: tq.TaskQueue) -> tq.TaskQueue:
    @queue.task(name="mail.send", queue="mail", priority=5, max_attempts=7)
    def send(to: str, subject: str = "") -> str:
        return f"sent to {to}"

    @queue.task(name="report.build", retry_delay=timedelta(seconds=1))
    def build(day: str) -> None:
        raise RuntimeError(f"no data for {day}")

    return queue
