"""A row written around the queue with params that are not a JSON object fails alone, at once, and says why.

Raw SQL can put anything in the params column: a JSON array, a string, or a
document nested deeper than Python's JSON parser follows (PostgreSQL's jsonb
and SQLite keep 5,000 levels; MariaDB's JSON check refuses 32).  Such a task
is recorded FAILED with a ``last_error`` saying what is wrong, without
running and without retries; the tasks claimed with it run; the worker lives.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import executions
from tests.backends import Backend
from tests.helpers import run_cli

TABLE = tq.Task.__table__
DEEP = 5000

POISONS = [
    pytest.param("[1, 2]", "params is not a JSON object: got a list", id="array"),
    pytest.param('"send it"', "params is not a JSON object: got a string", id="string"),
    pytest.param(
        '{"a": ' * DEEP + "1" + "}" * DEEP,
        "params is not valid JSON here: nested too deeply to decode",
        id="nested-5000-deep",
        marks=pytest.mark.backends("sqlite", "postgres"),  # MariaDB refuses to store it at all
    ),
    pytest.param(
        "{not json",
        "params is not valid JSON: Expecting property name",
        id="not-json",
        marks=pytest.mark.backends("sqlite"),  # the others check JSON as they store it
    ),
]


def five_good_and_one_poisoned(queue: tq.TaskQueue, engine: sa.Engine, poison: str) -> int:
    """Five "record" tasks and a sixth whose params raw SQL replaced with ``poison``; the sixth's id."""
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(6)])
        session.commit()
    with engine.begin() as conn:
        poisoned = conn.scalar(sa.select(TABLE.c.id).where(TABLE.c.params["key"].as_integer() == 3))
        conn.execute(
            sa.text("UPDATE sa_taskqueue_task SET params = :poison WHERE id = :id"),
            {
                "poison": poison,
                "id": poisoned,
            },
        )
    return int(poisoned)


def outcomes(engine: sa.Engine) -> dict[int, tuple[tq.TaskStatus, int, str | None]]:
    """id -> (status, attempts, last_error), read without decoding any params."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(TABLE.c.id, TABLE.c.status, TABLE.c.attempts, TABLE.c.last_error))
        return {row.id: (row.status, row.attempts, row.last_error) for row in rows}


@pytest.mark.parametrize(("poison", "reason"), POISONS)
def test_a_malformed_row_fails_alone_for_good_and_its_batch_runs(
    queue: tq.TaskQueue, engine: sa.Engine, poison: str, reason: str
) -> None:
    poisoned = five_good_and_one_poisoned(queue, engine, poison)
    worker = queue.run_worker(concurrency=6, burst=True, poll_interval=0.05)
    with engine.connect() as conn:
        claims = conn.scalar(sa.select(sa.func.count(sa.distinct(TABLE.c.started_at))))
    assert claims == 1, "the poisoned row and its batch-mates were claimed together, in one claim"
    assert (worker.processed, worker.failed) == (5, 1)
    assert executions(engine) == {0: 1, 1: 1, 2: 1, 4: 1, 5: 1}
    found = outcomes(engine)
    status, attempts, last_error = found.pop(poisoned)
    assert (status, attempts) == (tq.TaskStatus.FAILED, 1), "failed for good: no attempt could run it"
    assert last_error is not None and "MalformedTask" in last_error and reason in last_error, last_error
    assert {(status, attempts) for status, attempts, _ in found.values()} == {(tq.TaskStatus.COMPLETED, 1)}


def test_a_malformed_claim_is_not_retried_even_with_attempts_left(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    poisoned = five_good_and_one_poisoned(queue, engine, "[1, 2]")
    claimed = {task.id: task for task in queue.claim(limit=6)}
    assert claimed[poisoned].malformed == "params is not a JSON object: got a list"
    assert claimed[poisoned].params == {}
    assert all(task.malformed is None for task_id, task in claimed.items() if task_id != poisoned)
    assert queue.fail(claimed[poisoned], tq.MalformedTask(claimed[poisoned].malformed or ""))
    assert outcomes(engine)[poisoned][:2] == (tq.TaskStatus.FAILED, 1)


def test_fail_without_retry_ends_a_task_at_once(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    five_good_and_one_poisoned(queue, engine, "{}")
    first, second = queue.claim(limit=2)
    assert queue.fail(first, "gave up", retry=False)
    assert queue.fail(second, "try again later")
    found = outcomes(engine)
    assert found[first.id] == (tq.TaskStatus.FAILED, 1, "gave up")
    assert found[second.id][:2] == (tq.TaskStatus.QUEUED, 1), "a plain failure is still retried"


@pytest.mark.slow
def test_the_command_line_worker_survives_a_malformed_row(
    backend: Backend, default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    poisoned = five_good_and_one_poisoned(default_queue, engine, '"send it"')
    result = run_cli("worker", "tests.cli_app:queue", "--burst", "--concurrency", "6", url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "params is not a JSON object: got a string" in result.stderr
    assert executions(engine) == {0: 1, 1: 1, 2: 1, 4: 1, 5: 1}
    assert outcomes(engine)[poisoned][:2] == (tq.TaskStatus.FAILED, 1)
