"""A deadlock the server ends is contention between workers, retried and logged as such, not an outage."""

from __future__ import annotations

import logging
import threading

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.exceptions import translate_database_errors
from tests.app import executions


def a_deadlock(queue: tq.TaskQueue, engine: sa.Engine) -> tq.DatabaseUnavailable:
    """The error a statement meets when the server ends two transactions' wait for each other.

    Two connections each lock one task row, then each asks for the other's;
    the server rolls one of them back.  Returned as the queue raises it.
    """
    with Session(engine) as session:
        ids = [queue.enqueue(session, "record", {"key": key}).id for key in (10, 11)]
        session.commit()
    table = queue.table
    locked_first = threading.Barrier(2, timeout=30)
    errors: list[tq.DatabaseUnavailable] = []

    def lock(first: int, then: int) -> None:
        with engine.connect() as conn:
            try:
                with translate_database_errors(engine, table), conn.begin():
                    for step, task_id in enumerate((first, then)):
                        conn.execute(
                            sa.update(table).where(table.c.id == task_id).values(priority=table.c.priority)
                        )
                        if step == 0:
                            locked_first.wait()
            except tq.DatabaseUnavailable as error:
                errors.append(error)

    both = [threading.Thread(target=lock, args=order) for order in (ids, ids[::-1])]
    for thread in both:
        thread.start()
    for thread in both:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in both)
    assert len(errors) == 1, f"one transaction of the two is the deadlock's victim: {errors}"
    with Session(engine) as session:
        session.execute(sa.delete(table).where(table.c.id.in_(ids)))
        session.commit()
    return errors[0]


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_a_claim_ended_as_a_deadlocks_victim_is_retried_and_not_logged_as_an_outage(
    default_queue: tq.TaskQueue,
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = default_queue
    deadlock = a_deadlock(queue, engine)
    with Session(engine) as session:
        queue.enqueue(session, "record", {"key": 1})
        session.commit()
    real_claim = queue.claim
    met: list[tq.DatabaseUnavailable] = []

    def claim_meeting_the_deadlock_once(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        if not met:
            met.append(deadlock)
            raise deadlock
        return real_claim(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(queue, "claim", claim_meeting_the_deadlock_once)
    with caplog.at_level(logging.INFO, logger="sa_taskqueue"):
        worker = queue.run_worker(concurrency=1, burst=True, poll_interval=0.05)
    assert met, "the claim met the deadlock"
    assert (worker.processed, executions(engine)) == (1, {1: 1})
    assert "lost a lock race with another connection" in caplog.text
    assert "database unavailable" not in caplog.text
    assert "database is back" not in caplog.text
