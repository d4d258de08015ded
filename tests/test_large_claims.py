"""A claim may ask for any number of tasks, on every strategy, and gets them all."""

from __future__ import annotations

from datetime import timedelta

import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import make_queue


def enqueue_many(queue: tq.TaskQueue, engine: sa.Engine, count: int) -> list[int]:
    with Session(engine) as session:
        ids = queue.enqueue_many(session, "record", [{"key": n} for n in range(count)])
        session.commit()
        return ids


def running_ids(engine: sa.Engine) -> set[int]:
    with engine.connect() as conn:
        return set(conn.scalars(sa.select(tq.Task.id).where(tq.Task.status == tq.TaskStatus.RUNNING)))


def test_a_claim_of_2000_takes_2000_due_tasks_in_claim_order(
    engine: sa.Engine, strategy_name: str, lease: timedelta
) -> None:
    queue = make_queue(engine, strategy_name, lease)
    ids = enqueue_many(queue, engine, 2100)
    claimed = queue.claim(limit=2000)
    assert [task.id for task in claimed] == ids[:2000]
    assert running_ids(engine) == set(ids[:2000])
    rest = queue.claim(limit=2000)
    assert [task.id for task in rest] == ids[2000:]
    # Every claimed task is still held: its outcome is written.
    assert queue.complete_many(claimed + rest) == set(ids)
    queue.close()


def test_a_claim_larger_than_what_is_due_takes_everything_due(
    engine: sa.Engine, strategy_name: str, lease: timedelta
) -> None:
    queue = make_queue(engine, strategy_name, lease)
    ids = enqueue_many(queue, engine, 900)
    assert [task.id for task in queue.claim(limit=5000)] == ids
    assert queue.claim(limit=5000) == []
    queue.close()
