"""Whatever a task raises, its failure is recorded at once, storable and bounded, and logged bounded.

A message with a NUL in it (which PostgreSQL refuses to store) or an unpaired
surrogate is stored with those characters escaped; a message of 50 MB is
stored and logged as its head and tail around a marker saying how much was
cut, in at most `MAX_ERROR_LENGTH` characters.
"""

from __future__ import annotations

import logging

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.error_text import MAX_ERROR_LENGTH, bounded_text, format_error
from tests.helpers import task_row

BIG = 50_000_000


def register_raising_tasks(queue: tq.TaskQueue) -> None:
    @queue.task(name="raise_nul")
    def raise_nul() -> None:
        raise ValueError("before\x00after \ud800 lone")

    @queue.task(name="raise_huge")
    def raise_huge() -> None:
        raise ValueError("HEAD" + "x" * BIG + "TAIL")


def enqueue(queue: tq.TaskQueue, engine: sa.Engine, name: str, max_attempts: int) -> int:
    with Session(engine) as session:
        task_id = queue.enqueue(session, name, max_attempts=max_attempts).id
        session.commit()
    return task_id


def failure_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "failed after" in record.getMessage()]


def test_a_message_with_a_nul_is_recorded_escaped_and_the_task_retried_at_once(
    queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    register_raising_tasks(queue)
    task_id = enqueue(queue, engine, "raise_nul", max_attempts=3)
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        worker = queue.run_worker(burst=True, poll_interval=0.05)
    assert worker.failed == 1
    row = task_row(engine, task_id)
    assert (row.status, row.attempts) == (tq.TaskStatus.QUEUED, 1), "recorded at once, to be retried"
    assert row.last_error is not None
    assert "ValueError: before\\x00after \\ud800 lone" in row.last_error, row.last_error
    assert "\x00" not in row.last_error
    assert not any("could not record" in record.getMessage() for record in caplog.records)
    [line] = failure_lines(caplog)
    assert "before\\x00after \\ud800 lone" in line


def test_a_50_mb_message_is_stored_and_logged_as_its_head_and_tail(
    queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    register_raising_tasks(queue)
    task_id = enqueue(queue, engine, "raise_huge", max_attempts=1)
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        worker = queue.run_worker(burst=True, poll_interval=0.05)
    assert worker.failed == 1
    row = task_row(engine, task_id)
    assert row.status == tq.TaskStatus.FAILED
    stored = row.last_error or ""
    assert len(stored) <= MAX_ERROR_LENGTH
    assert stored.startswith("Traceback (most recent call last):")
    assert "in raise_huge" in stored, "the head says where"
    assert stored.endswith("xxxxTAIL\n"), "the tail ends the message"
    assert " characters cut] ..." in stored
    [line] = failure_lines(caplog)
    assert len(line) <= MAX_ERROR_LENGTH
    assert "HEADxxxx" in line and line.endswith("xxxxTAIL") and " characters cut] ..." in line


def test_fail_records_an_error_text_no_database_would_store_as_given(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    register_raising_tasks(queue)
    task_id = enqueue(queue, engine, "raise_nul", max_attempts=1)
    [claimed] = queue.claim()
    assert queue.fail(claimed, "nul \x00 and surrogate \udfff")
    assert task_row(engine, task_id).last_error == "nul \\x00 and surrogate \\udfff"


def test_a_cut_keeps_head_and_tail_and_says_how_much_went() -> None:
    text = "H" * 100_000 + "T" * 100_000
    cut = bounded_text(text)
    assert len(cut) <= MAX_ERROR_LENGTH
    head, _, rest = cut.partition("\n... [")
    tail = rest.partition("] ...\n")[2]
    assert set(head) == {"H"} and set(tail) == {"T"}
    kept = len(head) + len(tail)
    assert f"{len(text) - kept:,} characters cut" in cut
    assert bounded_text("short") == "short"
    assert format_error("x" * MAX_ERROR_LENGTH) == "x" * MAX_ERROR_LENGTH, "at the bound, nothing is cut"
