"""A queue on a task table nobody created: ``tests.missing_table_app:queue``, for the missing-schema error.

`NeverMigrated` is a `TaskMixin` table on a Base of its own whose tables are
never created, so every enqueue into it meets a database without it.  The
queue is built on first access from $SA_TASKQUEUE_DATABASE_URL, for the
command line's ``--app``.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase

import sa_taskqueue as tq


class NeverMigratedBase(DeclarativeBase):
    pass


class NeverMigrated(tq.TaskMixin, NeverMigratedBase):
    __tablename__ = "never_migrated_task"


def register(queue: tq.TaskQueue) -> tq.TaskQueue:
    @queue.task(name="shop.mail")
    def mail(to: str) -> str:
        return to

    return queue


def __getattr__(name: str) -> Any:
    if name == "queue":
        engine = sa.create_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"])
        return register(tq.TaskQueue(engine, model=NeverMigrated))
    raise AttributeError(name)
