"""Cancelling running tasks, through real worker processes, and the progress running tasks report.

The worker processes are ``python -m tests.cancel_app``; their tasks write
what they did to ``test_execution`` (`tests.cancel_app.note`), so each test
reads from the database when a task started and what it saw.  Their lease
is 4 seconds: the heartbeat, which learns of cancels where no NOTIFY does,
beats every second.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import oracle
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.current_task import reset_current, set_current
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.features.cancellation import (
    cancel_queued_statement,
    request_cancel_statement,
    requested_cancels_statement,
    write_cancelled,
)
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy
from sa_taskqueue.worker.execution import ChildProcess, Outcome, TaskRaised
from sa_taskqueue.worker.progress import ProgressWriter
from tests.app import Execution
from tests.backends import Backend
from tests.cancel_app import SAW_CANCEL, STARTED, WRITTEN, make_cancel_queue
from tests.helpers import MovableClock, enqueue_one, run_cli, task_row, wait_until

ROOT = Path(__file__).resolve().parent.parent
LEASE = timedelta(seconds=4)
#: How long a test waits for a cancelled task to end: a heartbeat (1s) and the run's stop, with room to spare.
ENDS_WITHIN = 20.0

StartWorker = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def cancel_queue(engine: sa.Engine) -> Iterator[tq.TaskQueue]:
    queue = make_cancel_queue(engine, LEASE)
    yield queue
    queue.close()


@pytest.fixture
def start_worker(backend: Backend) -> Iterator[StartWorker]:
    """Start worker processes of `tests.cancel_app`; each is stopped (SIGTERM, then SIGKILL) at the end."""
    started: list[subprocess.Popen[str]] = []

    def start(*args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.cancel_app", "--url", backend.url, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in started:
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stderr is not None:
            process.stderr.close()


def notes(engine: sa.Engine, key: int) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.scalars(sa.select(Execution.note).where(Execution.task_key == key).order_by(Execution.id))
        )


def status(engine: sa.Engine, task_id: int) -> tq.TaskStatus:
    return task_row(engine, task_id).status


def cancel_once_started(
    engine: sa.Engine, queue: tq.TaskQueue, name: str, key: int, **params: object
) -> tuple[int, float]:
    """Enqueue ``name``, wait until it has started, cancel it: its id, and when the cancel was sent."""
    task_id = enqueue_one(queue, engine, name, {"key": key, **params}, max_attempts=3)
    wait_until(lambda: STARTED in notes(engine, key), 60, f"task {name} to start")
    sent = time.monotonic()
    result = queue.cancel_task(task_id, by="tester")
    assert result.state is tq.CancelState.RUNNING, result
    assert (
        result.message
        == f"task {task_id} is running: cancel requested; its worker stops it within one heartbeat"
    )
    return task_id, sent


def assert_cancelled_by_tester(engine: sa.Engine, queue: tq.TaskQueue, task_id: int) -> None:
    wait_until(lambda: status(engine, task_id) is tq.TaskStatus.CANCELLED, ENDS_WITHIN, "the task cancelled")
    row = task_row(engine, task_id)
    assert row.cancelled_by == "tester"
    assert row.cancel_requested_at is not None and row.finished_at is not None
    assert row.cancel_requested_at <= row.finished_at
    assert row.attempts == 1, "a cancelled task is never retried"
    assert row.result is None
    with pytest.raises(tq.TaskCancelled):
        queue.result(task_id, timeout=5)


# Each kind of run ---------------------------------------------------------------


def test_a_sync_task_checking_raise_if_cancelled_stops_and_ends_cancelled(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    start_worker()
    task_id, _sent = cancel_once_started(engine, cancel_queue, "loop_sync", 1)
    assert_cancelled_by_tester(engine, cancel_queue, task_id)
    assert cancel_queue.cancel_task(task_id).state is tq.CancelState.FINISHED


def test_a_sync_task_reading_cancel_requested_may_return_and_then_completes(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    """A task that sees the request and returns normally has finished its work: its success stands."""
    start_worker()
    task_id, _sent = cancel_once_started(engine, cancel_queue, "stop_when_cancelled", 2)
    wait_until(lambda: status(engine, task_id) is tq.TaskStatus.COMPLETED, ENDS_WITHIN, "the task completed")
    row = task_row(engine, task_id)
    assert row.result == "stopped of its own accord" and row.cancelled_by == "tester"


def test_an_async_task_gets_cancelled_error_at_its_next_await(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    start_worker()
    task_id, _sent = cancel_once_started(engine, cancel_queue, "loop_async", 3)
    assert_cancelled_by_tester(engine, cancel_queue, task_id)
    assert SAW_CANCEL in notes(engine, 3), "the coroutine saw CancelledError and ran its cleanup"


def test_a_task_process_is_interrupted_and_one_that_ignores_it_is_killed_after_the_grace(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    grace = 2.0
    start_worker("--isolation", "process", "--cancel-grace", str(grace))
    # A cooperative one: CancellationRequested ends it at once.
    cooperative, _sent = cancel_once_started(engine, cancel_queue, "loop_sync", 4)
    assert_cancelled_by_tester(engine, cancel_queue, cooperative)
    # One that catches it and runs on: killed once the grace has passed.
    stubborn, sent = cancel_once_started(engine, cancel_queue, "ignore_cancel", 5)
    wait_until(lambda: SAW_CANCEL in notes(engine, 5), ENDS_WITHIN, "the process to be told")
    assert_cancelled_by_tester(engine, cancel_queue, stubborn)
    assert time.monotonic() - sent >= grace, "killed only after its grace"
    assert notes(engine, 5) == [STARTED, SAW_CANCEL], "it ran on, ignoring it, until it was killed"


def test_a_transactional_task_cancelled_leaves_none_of_its_writes(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    if backend_for(engine.dialect).serialised_writes:
        # Its flushed write holds the database's one write lock until it ends: the cancel
        # itself, and the heartbeat, would wait for it (SQLite).
        pytest.skip("a transactional task holding the one write lock cannot be cancelled from outside")
    start_worker()
    task_id, _sent = cancel_once_started(engine, cancel_queue, "write_then_loop", 6)
    assert_cancelled_by_tester(engine, cancel_queue, task_id)
    assert WRITTEN not in notes(engine, 6), "its writes were rolled back"


@pytest.mark.requires("notify")
def test_where_the_database_notifies_the_worker_stops_the_task_at_once_not_at_its_heartbeat(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    """A 60-second lease: the heartbeat beats every 19 seconds; the cancel channel is heard at once."""
    start_worker("--lease", "60")
    task_id, sent = cancel_once_started(engine, cancel_queue, "loop_sync", 8)
    wait_until(lambda: status(engine, task_id) is tq.TaskStatus.CANCELLED, 10, "the task cancelled", 0.02)
    assert time.monotonic() - sent < 10


# The race with the task's own end ------------------------------------------------


def test_cancels_racing_completions_leave_each_task_exactly_one_outcome(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    """Each task is cancelled at about the time it ends; whichever write comes first is its one outcome."""
    seconds = 0.3
    count = 24
    # A longer lease than the others': under a loaded machine's stalls a lease lost would run a task twice.
    start_worker("--concurrency", "4", "--lease", "10")
    with Session(engine) as session:
        tasks = [
            cancel_queue.enqueue(session, "nap", {"key": n, "seconds": seconds}, max_attempts=3)
            for n in range(count)
        ]
        session.commit()
        ids = [task.id for task in tasks]
    rng = random.Random(7)

    def cancel_near_its_end(task_id: int) -> None:
        wait_until(lambda: task_row(engine, task_id).started_at is not None, 180, "the task to start", 0.02)
        time.sleep(max(0.0, seconds + rng.uniform(-0.15, 0.1)))
        cancel_queue.cancel_task(task_id, by="racer")

    threads = [threading.Thread(target=cancel_near_its_end, args=(task_id,)) for task_id in ids]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    finished = (tq.TaskStatus.COMPLETED, tq.TaskStatus.CANCELLED)
    wait_until(lambda: all(status(engine, i) in finished for i in ids), 120, "every task to end", 0.2)
    outcomes: dict[str, int] = {}
    for key, task_id in enumerate(ids):
        row = task_row(engine, task_id)
        outcomes[row.status] = outcomes.get(row.status, 0) + 1
        assert row.attempts == 1, "no task ran twice, none was retried"
        if row.status is tq.TaskStatus.COMPLETED:
            assert row.result == key
        else:
            assert row.result is None and row.cancelled_by == "racer", "a cancel never overwrote a success"
    assert sum(outcomes.values()) == count, outcomes


def test_the_fenced_write_decides_between_a_cancel_and_a_completion(
    engine: sa.Engine, cancel_queue: tq.TaskQueue
) -> None:
    """Whichever of the two outcome writes comes first stands; the other finds the task no longer held."""
    first = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0}, max_attempts=3)
    second = enqueue_one(cancel_queue, engine, "nap", {"key": 2, "seconds": 0}, max_attempts=3)
    claimed = {task.id: task for task in cancel_queue.claim(limit=2)}
    strategy = cancel_queue.strategy
    # Completed first: the cancel is refused.
    assert cancel_queue.complete(claimed[first], 1)
    assert not write_cancelled(strategy, engine, cancel_queue.table, claimed[first], utcnow())
    assert (status(engine, first), task_row(engine, first).result) == (tq.TaskStatus.COMPLETED, 1)
    # Cancelled first: the completion is refused.
    assert write_cancelled(strategy, engine, cancel_queue.table, claimed[second], utcnow())
    assert not cancel_queue.complete(claimed[second], 2)
    assert (status(engine, second), task_row(engine, second).result) == (tq.TaskStatus.CANCELLED, None)


# Messages -------------------------------------------------------------------------


def test_the_command_line_tells_queued_running_finished_and_missing_tasks_apart(
    backend: Backend, engine: sa.Engine, cancel_queue: tq.TaskQueue
) -> None:
    queued = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0})
    running = enqueue_one(cancel_queue, engine, "nap", {"key": 2, "seconds": 0})
    done = enqueue_one(cancel_queue, engine, "nap", {"key": 3, "seconds": 0})
    cancel_queue.cancel(queued)  # (so that the claim below takes the other two)
    claimed = {task.id: task for task in cancel_queue.claim(limit=2)}
    assert cancel_queue.complete(claimed[done], 3)
    with engine.begin() as conn:  # queued again, for the command to cancel
        conn.execute(sa.update(tq.Task).where(tq.Task.id == queued).values(status="queued", finished_at=None))

    said = run_cli("cancel", str(queued), url=backend.url)
    assert (said.returncode, said.stdout.strip()) == (
        0,
        f"cancelled task {queued}: it was queued and will never run",
    )
    assert task_row(engine, queued).cancelled_by.startswith("cli")  # type: ignore[union-attr]

    said = run_cli("cancel", str(running), url=backend.url)
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip() == (
        f"task {running} is running: cancel requested; its worker stops it within one heartbeat"
    )
    assert status(engine, running) is tq.TaskStatus.RUNNING

    said = run_cli("cancel", str(done), url=backend.url)
    assert said.returncode == 1
    assert said.stderr.strip() == f"error: task {done} already completed: nothing cancelled"

    said = run_cli("cancel", "987654", url=backend.url)
    assert said.returncode == 1
    assert said.stderr.strip() == "error: task 987654 does not exist"


def test_cancel_keeps_its_bool_and_cancel_task_tells_the_states_apart(
    engine: sa.Engine, cancel_queue: tq.TaskQueue
) -> None:
    queued = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0})
    result = cancel_queue.cancel_task(queued, by="me")
    assert (result.state, bool(result), result.status) == (tq.CancelState.QUEUED, True, tq.TaskStatus.QUEUED)
    row = task_row(engine, queued)
    assert (row.status, row.cancelled_by) == (tq.TaskStatus.CANCELLED, "me")
    assert cancel_queue.cancel(queued) is False
    assert cancel_queue.cancel_task(queued).state is tq.CancelState.FINISHED
    assert cancel_queue.cancel_task(987654).state is tq.CancelState.MISSING
    with pytest.raises(ValueError, match="cancelled_by"):
        cancel_queue.cancel_task(queued, by=" ")


# Progress ---------------------------------------------------------------------------


class StepClock:
    """Monotonic seconds that move only when the test moves them."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_is_written_at_most_once_a_second_the_last_report_winning(
    engine: sa.Engine, cancel_queue: tq.TaskQueue
) -> None:
    task_id = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0})
    [task] = cancel_queue.claim(limit=1)
    clock = StepClock()
    writer = ProgressWriter(cancel_queue, clock=clock)
    writer.report(task, 0.1, {"step": 1})
    assert writer.write_due() is None
    assert cancel_queue.progress(task_id) == tq.TaskProgress(
        0.1, {"step": 1}, task_row(engine, task_id).progress_at
    )
    clock.now += 0.5
    writer.report(task, 0.2, {"step": 2})
    writer.report(task, 0.3, {"step": 3})
    assert writer.write_due() == pytest.approx(0.5), "not before a second has passed"
    assert cancel_queue.progress(task_id).progress == 0.1  # type: ignore[union-attr]
    clock.now += 0.5
    assert writer.write_due() is None
    progress = cancel_queue.progress(task_id)
    assert progress is not None and (progress.progress, progress.note) == (0.3, {"step": 3}), (
        "the last one won"
    )
    assert (writer.written, writer.refused) == (2, 0)


def test_progress_is_refused_once_the_lease_is_lost(engine: sa.Engine, cancel_queue: tq.TaskQueue) -> None:
    task_id = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0})
    [task] = cancel_queue.claim(limit=1)
    clock = StepClock()
    writer = ProgressWriter(cancel_queue, clock=clock)
    writer.report(task, 0.5, None)
    writer.write_due()
    with engine.begin() as conn:  # another worker took it over
        conn.execute(sa.update(tq.Task).where(tq.Task.id == task_id).values(locked_by="another-worker"))
    clock.now += 2
    writer.report(task, 0.9, {"late": True})
    writer.write_due()
    assert (writer.written, writer.refused) == (1, 1)
    assert cancel_queue.progress(task_id).progress == 0.5  # type: ignore[union-attr]


def test_progress_past_the_lease_is_refused(engine: sa.Engine, strategy_name: str) -> None:
    clock = MovableClock()
    queue = make_cancel_queue(engine, LEASE)
    queue_on_clock = make_cancel_queue(engine, LEASE, clock.now)
    try:
        task_id = enqueue_one(queue_on_clock, engine, "nap", {"key": 1, "seconds": 0})
        [task] = queue_on_clock.claim(limit=1)
        clock.advance(LEASE + timedelta(seconds=1))
        writer = ProgressWriter(queue_on_clock, clock=StepClock())
        writer.report(task, 0.5, None)
        writer.write_due()
        assert (writer.written, writer.refused) == (0, 1)
        assert queue.progress(task_id) is None
    finally:
        queue.close()
        queue_on_clock.close()


def test_a_running_task_that_reports_progress_is_still_held_and_not_recovered(
    engine: sa.Engine, strategy_name: str
) -> None:
    queue = make_cancel_queue(engine, LEASE, strategy=strategy_name)
    try:
        task_id = enqueue_one(queue, engine, "nap", {"key": 1, "seconds": 0})
        [task] = queue.claim(limit=1)
        writer = ProgressWriter(queue, clock=StepClock())
        writer.report(task, 0.5, None)
        writer.write_due()
        assert writer.written == 1
        assert queue.recover() == 0, "its claim still holds it (the advisory lock too)"
        assert status(engine, task_id) is tq.TaskStatus.RUNNING
        assert queue.complete(task, None)
        assert status(engine, task_id) is tq.TaskStatus.COMPLETED
    finally:
        queue.close()


def test_a_running_task_reports_progress_readable_from_the_api_and_show(
    backend: Backend, engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    start_worker()
    task_id = enqueue_one(cancel_queue, engine, "report", {"key": 7, "steps": 40})
    wait_until(lambda: STARTED in notes(engine, 7), 60, "the reports to be made")

    def last_written() -> bool:
        progress = cancel_queue.progress(task_id)
        return progress is not None and progress.progress == 1.0

    wait_until(last_written, 10, "the last report written (within a second of it)")
    progress = cancel_queue.progress(task_id)
    assert progress is not None and progress.note == {"step": 40} and progress.at is not None
    shown = run_cli("show", str(task_id), "--json", url=backend.url)
    assert shown.returncode == 0, shown.stderr
    assert '"progress": 1.0' in shown.stdout and '"step": 40' in shown.stdout
    cancel_queue.cancel_task(task_id)
    wait_until(lambda: status(engine, task_id) is tq.TaskStatus.COMPLETED, ENDS_WITHIN, "the task to end")


def test_a_task_process_reports_progress_its_worker_writes(
    engine: sa.Engine, cancel_queue: tq.TaskQueue, start_worker: StartWorker
) -> None:
    worker = start_worker("--isolation", "process")
    task_id = enqueue_one(cancel_queue, engine, "report", {"key": 9, "steps": 40})
    wait_until(lambda: STARTED in notes(engine, 9), 60, "the reports to be made")
    with engine.connect() as conn:
        pid = conn.scalar(sa.select(Execution.pid).where(Execution.task_key == 9))
    assert pid != worker.pid, "the task ran in a process of its own"

    def last_written() -> bool:
        progress = cancel_queue.progress(task_id)
        return progress is not None and progress.progress == 1.0

    wait_until(last_written, 10, "the last report written (within a second of it)")
    assert status(engine, task_id) is tq.TaskStatus.RUNNING
    progress = cancel_queue.progress(task_id)
    assert progress is not None and progress.note == {"step": 40} and progress.at is not None
    # Cancelled, the task process is interrupted as ever; its progress stays readable.
    cancel_queue.cancel_task(task_id)
    wait_until(lambda: status(engine, task_id) is tq.TaskStatus.CANCELLED, ENDS_WITHIN, "the task cancelled")
    assert cancel_queue.progress(task_id) == progress


def run_child(func: Callable[..., Any], received: list[tuple[float, Any]]) -> ChildProcess:
    """``func`` in a task process, as a worker runs it: its reports go to ``received``."""
    now = utcnow()
    task = tq.ClaimedTask(1, "report", "default", 0, {}, 1, 1, now, now, now, "tester", now)
    token = set_current(tq.TaskContext(task, None))
    try:
        return ChildProcess(func, {}, lambda: None, lambda progress, note: received.append((progress, note)))
    finally:
        reset_current(token)


def reports_then_returns_a_lookalike() -> tuple[str, float, None]:
    for step in range(1, 501):
        tq.current_task().report(step / 500, note={"step": step})
    return ("progress", 0.5, None)  # (a result shaped like a report: still the outcome)


async def reports_then_returns_a_lookalike_async() -> tuple[str, float, None]:
    return reports_then_returns_a_lookalike()


@pytest.mark.parametrize("func", [reports_then_returns_a_lookalike, reports_then_returns_a_lookalike_async])
def test_a_task_process_sends_its_reports_before_its_outcome_the_last_one_winning(
    func: Callable[[], Any],
) -> None:
    received: list[tuple[float, Any]] = []
    outcome = run_child(func, received).wait(30)
    assert outcome.ok and outcome.result == ("progress", 0.5, None), outcome
    assert received[-1] == (1.0, {"step": 500}), "the last report reached the worker before the outcome"
    steps = [note["step"] for _progress, note in received]
    assert steps == sorted(steps) and len(set(steps)) == len(steps), "in order, none twice (some coalesced)"


def reports_until_cancelled() -> None:
    step = 0
    while True:
        step += 1
        tq.current_task().report(0.5, note={"step": step})
        time.sleep(0.001)


def test_a_task_process_cancelled_while_it_reports_tells_its_worker_so() -> None:
    received: list[tuple[float, Any]] = []
    child = run_child(reports_until_cancelled, received)
    outcome: Outcome | None = None
    deadline = time.monotonic() + 30
    while outcome is None and not received and time.monotonic() < deadline:
        stop = time.monotonic() + 0.05
        outcome = child.wait(None, lambda: stop)  # noqa: B023 - read within this very call
    assert outcome is None and received, "it reported while it ran"
    child.request_cancel()
    outcome = child.wait(30)
    assert isinstance(outcome.error, TaskRaised), outcome
    assert outcome.error.type_name == "CancellationRequested", outcome.error_text


def test_current_task_outside_a_task_and_bad_reports_say_what_is_wrong() -> None:
    with pytest.raises(RuntimeError, match="only available inside a task"):
        tq.current_task()
    context = tq.TaskContext(tq.ClaimedTask.__new__(tq.ClaimedTask), None)
    with pytest.raises(ValueError, match="from 0 to 1"):
        context.report(1.5)
    with pytest.raises(TypeError, match="number from 0 to 1"):
        context.report("half")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="progress note is not JSON"):
        context.report(0.5, note=object())


# The SQL Oracle is sent (compiled only: no Oracle server in the test run) -------------


def test_the_cancel_and_progress_statements_compile_for_oracle() -> None:
    table = tq.Task.__table__
    dialect = oracle.dialect()
    now = utcnow()

    def text(statement: object) -> str:
        return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]

    queued = text(cancel_queued_statement(table, 1, "me", now))
    assert queued.startswith("UPDATE sa_taskqueue_task SET status=:status, finished_at=:finished_at")
    assert "cancel_requested_at=:cancel_requested_at, cancelled_by=:cancelled_by" in queued
    running = text(request_cancel_statement(table, 1, "me", now))
    assert "cancel_requested_at IS NULL" in running and "SET cancel_requested_at=" in running
    asked = text(requested_cancels_statement(table, [3, 1, 2]))
    assert asked.startswith(
        "SELECT sa_taskqueue_task.id FROM sa_taskqueue_task WHERE sa_taskqueue_task.id IN"
    )
    assert "cancel_requested_at IS NOT NULL" in asked
    # The progress write is the fenced UPDATE every outcome goes through (`LeaseWrites.finish`).
    strategy = SkipLockedStrategy()
    fenced = sa.update(table).where(strategy.holds(table)).values(progress=0.5, progress_note={"a": 1})
    fenced_text = text(fenced)
    assert "locked_by = :held_by" in fenced_text and "locked_until > :held_now" in fenced_text
    assert "progress=:progress, progress_note=:progress_note" in fenced_text


def test_a_cancelled_task_run_again_is_no_longer_cancelled(
    engine: sa.Engine, cancel_queue: tq.TaskQueue
) -> None:
    task_id = enqueue_one(cancel_queue, engine, "nap", {"key": 1, "seconds": 0})
    assert cancel_queue.cancel_task(task_id, by="me").state is tq.CancelState.QUEUED
    assert Admin(engine, cancel_queue.table).retry(task_id) == 1
    row = task_row(engine, task_id)
    assert (row.status, row.cancel_requested_at, row.cancelled_by) == (tq.TaskStatus.QUEUED, None, None)
