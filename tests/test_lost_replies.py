"""An outcome the database committed but whose answer was lost is known as recorded: no false alarm.

A connection can break after the server has committed a statement and
before its answer arrives.  The worker then writes the outcome again; the
row is no longer running under its claim (its own first write finished it),
and the worker must tell that apart from another worker having taken the
task over.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import task_row
from tests.link import Link


@pytest.mark.backends("postgres", "mysql", "mariadb")
@pytest.mark.parametrize("outcome", ["completed", "failed"])
def test_an_outcome_committed_before_its_connection_broke_is_not_reported_as_taken_over(
    backend: Backend,
    engine: sa.Engine,
    strategy_name: str,
    link: Link,
    outcome: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    linked = sa.create_engine(link.url(backend.url))
    queue = tq.TaskQueue(linked, strategy=strategy_name)

    @queue.task(name="answer_lost", max_attempts=2, retry_delay=timedelta(hours=1))
    def answer_lost() -> str:
        # The worker's next statement is this task's outcome.
        link.lose_next_reply()
        if outcome == "failed":
            raise RuntimeError("failed on purpose")
        return "done"

    with Session(engine) as session:
        task_id = queue.enqueue(session, "answer_lost", {}).id
        session.commit()
    try:
        with caplog.at_level(logging.INFO, logger="sa_taskqueue"):
            queue.run_worker(burst=True, poll_interval=0.05)
    finally:
        queue.close()
        linked.dispose()
    assert link.replies_lost == 1, "the outcome's answer was lost on the way back"
    assert "database unavailable" in caplog.text, "the worker saw its connection break"
    row = task_row(engine, task_id)
    if outcome == "completed":
        assert row.status == tq.TaskStatus.COMPLETED
        assert row.result == "done"
    else:
        assert row.status == tq.TaskStatus.QUEUED, "retried later, as its first write said"
        assert "failed on purpose" in (row.last_error or "")
    assert "taken over" not in caplog.text
    assert "will run again" not in caplog.text
