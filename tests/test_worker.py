"""The worker runs registered functions only, records every outcome, and keeps long tasks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.worker import worker as worker_module
from tests.app import executions, make_queue
from tests.backends import Backend
from tests.helpers import MovableClock, statements_sent, task_row, wait_until
from tests.helpers import task_rows as rows


def test_a_burst_worker_runs_every_due_task_once_and_returns(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(40)])
        session.commit()
    worker = queue.run_worker(concurrency=4, burst=True, poll_interval=0.05)
    assert (worker.processed, worker.failed) == (40, 0)
    assert executions(engine) == dict.fromkeys(range(40), 1)
    assert {(t.status, t.result) for t in rows(engine)} == {
        (tq.TaskStatus.COMPLETED, t.params["key"]) for t in rows(engine)
    }


def enqueue_tasks_finishing_together(queue: tq.TaskQueue, engine: sa.Engine, count: int) -> None:
    """``count`` "together" tasks, each returning its ``n`` once all ``count`` have started."""
    together = threading.Barrier(count, timeout=30)

    @queue.task(name="together")
    def finish_together(n: int) -> int:
        together.wait()
        return n

    with Session(engine) as session:
        queue.enqueue_many(session, "together", [{"n": n} for n in range(count)])
        session.commit()


def completion_statements(queue: tq.TaskQueue) -> AbstractContextManager[list[str]]:
    """The completions the queue sends meanwhile (on PostgreSQL, UPDATEs in a WITH announcing the ids)."""
    return statements_sent(queue, lambda sql: "UPDATE" in sql.upper() and "finished_at" in sql)


def test_tasks_finishing_together_are_recorded_in_fewer_statements_each_before_its_slot_frees(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    slots = 8
    enqueue_tasks_finishing_together(queue, engine, slots)
    recorded: list[tuple[int, tq.TaskStatus]] = []

    def on_success(task: tq.ClaimedTask, _result: object) -> None:
        # A slot is freed (and its hook called) only once its outcome is written.
        recorded.append((task.id, task_row(engine, task.id).status))

    with completion_statements(queue) as completions:
        worker = queue.run_worker(concurrency=slots, burst=True, poll_interval=0.05, on_success=on_success)
    assert worker.processed == slots
    assert {(t.params["n"], t.status, t.result) for t in rows(engine)} == {
        (n, tq.TaskStatus.COMPLETED, n) for n in range(slots)
    }
    assert len(recorded) == slots and {status for _, status in recorded} == {tq.TaskStatus.COMPLETED}
    if queue.strategy.name != "advisory_lock":  # each advisory task releases its own lock
        assert 0 < len(completions) < slots, completions


@pytest.mark.backends("sqlite", "mysql", "mariadb")  # (PostgreSQL claims ahead during the write, by design)
def test_with_no_hooks_a_slot_is_freed_for_the_next_claim_only_once_its_success_is_written(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    slots = 2
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(8)])
        session.commit()
    started: list[int] = []
    unwritten_when_started: list[list[int]] = []

    def on_start(task: tq.ClaimedTask) -> None:
        # With no on_success hook, a slot's thread hands its success over and
        # is free at once; the slot is not, until that success is written.
        unwritten_when_started.append(
            [i for i in started if task_row(engine, i).status != tq.TaskStatus.COMPLETED]
        )
        started.append(task.id)

    # A success waits for the other slot's, whose thread writes both.
    worker = queue.run_worker(
        concurrency=slots, burst=True, poll_interval=0.05, completion_delay=600, on_start=on_start
    )
    assert worker.processed == 8
    # Never more tasks claimed and not written than slots: each start leaves room for itself.
    assert max(len(unwritten) for unwritten in unwritten_when_started) <= slots - 1, unwritten_when_started


def test_successes_of_slots_finishing_together_go_in_one_statement_while_none_is_left_running(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    slots = 8
    enqueue_tasks_finishing_together(queue, engine, slots)
    # SQLAlchemy's events see the batched completion like any other statement.
    with completion_statements(queue) as completions:
        # A delay far longer than the test: the batch goes once no slot runs, not when it ends.
        worker = queue.run_worker(concurrency=slots, burst=True, poll_interval=0.05, completion_delay=600)
    assert worker.processed == slots
    assert {(t.params["n"], t.status, t.result) for t in rows(engine)} == {
        (n, tq.TaskStatus.COMPLETED, n) for n in range(slots)
    }
    if queue.strategy.name != "advisory_lock":  # each advisory task releases its own lock
        assert len(completions) == 1, completions


def enqueue_tasks_ending_together(queue: tq.TaskQueue, engine: sa.Engine, fails: list[bool]) -> None:
    """One "fail_or_not" task per entry, run once: once all have started, each raises (True) or returns."""
    together = threading.Barrier(len(fails), timeout=30)

    @queue.task(name="fail_or_not", max_attempts=1)
    def fail_or_not(n: int, fail: bool) -> int:
        together.wait()
        if fail:
            raise ValueError(f"task {n} failed")
        return n

    with Session(engine) as session:
        queue.enqueue_many(session, "fail_or_not", [{"n": n, "fail": fail} for n, fail in enumerate(fails)])
        session.commit()


def ended_as(engine: sa.Engine) -> dict[int, tuple[tq.TaskStatus, object]]:
    """Each "fail_or_not" task's status and its result, or the last line of its error."""
    return {
        t.params["n"]: (t.status, t.result if t.last_error is None else t.last_error.strip().splitlines()[-1])
        for t in rows(engine)
    }


def test_failures_of_slots_failing_together_go_in_one_statement_while_none_is_left_running(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    slots = 8
    enqueue_tasks_ending_together(queue, engine, [True] * slots)
    with completion_statements(queue) as writes:
        worker = queue.run_worker(concurrency=slots, burst=True, poll_interval=0.05, completion_delay=600)
    assert (worker.processed, worker.failed) == (0, slots)
    assert ended_as(engine) == {
        n: (tq.TaskStatus.FAILED, f"ValueError: task {n} failed") for n in range(slots)
    }
    if queue.strategy.name != "advisory_lock":  # each advisory task releases its own lock
        assert len(writes) == 1, writes


def test_successes_and_failures_ending_together_go_in_one_statement_for_each(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    fails = [n % 2 == 1 for n in range(8)]
    enqueue_tasks_ending_together(queue, engine, fails)
    with completion_statements(queue) as writes:
        worker = queue.run_worker(concurrency=8, burst=True, poll_interval=0.05, completion_delay=600)
    assert (worker.processed, worker.failed) == (4, 4)
    assert ended_as(engine) == {
        n: (tq.TaskStatus.FAILED, f"ValueError: task {n} failed") if fail else (tq.TaskStatus.COMPLETED, n)
        for n, fail in enumerate(fails)
    }
    if queue.strategy.name != "advisory_lock":
        assert len(writes) == 2, writes


def test_an_on_failure_hook_is_called_once_the_failure_is_written(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    slots = 4
    enqueue_tasks_ending_together(queue, engine, [True] * slots)
    seen: list[tuple[tq.TaskStatus, str]] = []

    def on_failure(task: tq.ClaimedTask, error: BaseException) -> None:
        seen.append((task_row(engine, task.id).status, str(error)))

    with completion_statements(queue) as writes:
        worker = queue.run_worker(
            concurrency=slots, burst=True, poll_interval=0.05, completion_delay=600, on_failure=on_failure
        )
    assert worker.failed == slots
    assert sorted(seen) == sorted((tq.TaskStatus.FAILED, f"task {n} failed") for n in range(slots))
    if queue.strategy.name != "advisory_lock":
        assert len(writes) == 1, writes


def long_and_quick_tasks(queue: tq.TaskQueue) -> tuple[threading.Event, threading.Event]:
    """Register "long", which returns once the first event is set, and "quick", which sets the second."""
    long_may_end, quick_returned = threading.Event(), threading.Event()

    @queue.task(name="long")
    def long_task() -> str:
        long_may_end.wait(120)
        return "long"

    @queue.task(name="quick")
    def quick_task() -> str:
        quick_returned.set()
        return "quick"

    return long_may_end, quick_returned


def test_a_success_waits_for_a_slot_still_running_no_longer_than_the_completion_delay(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    long_may_end, _ = long_and_quick_tasks(queue)
    with Session(engine) as session:
        long = queue.enqueue(session, "long", {})
        session.commit()
        long_id = long.id
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, completion_delay=0.2)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: task_row(engine, long_id).status == tq.TaskStatus.RUNNING, 30, "the long task")
        with Session(engine) as session:
            quick = queue.enqueue(session, "quick", {})
            session.commit()
            quick_id = quick.id
        wait_until(
            lambda: task_row(engine, quick_id).status == tq.TaskStatus.COMPLETED,
            30,
            "the quick task's success, written while the long task still runs",
        )
        assert task_row(engine, long_id).status == tq.TaskStatus.RUNNING
    finally:
        long_may_end.set()
        worker.stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert task_row(engine, long_id).status == tq.TaskStatus.COMPLETED


def test_a_success_waits_for_a_slot_still_running_and_they_go_in_one_statement(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    long_may_end, quick_returned = long_and_quick_tasks(queue)
    with Session(engine) as session:
        queue.enqueue(session, "long", {})
        queue.enqueue(session, "quick", {})
        session.commit()
    worker = tq.Worker(queue, concurrency=2, burst=True, poll_interval=0.05, completion_delay=600)
    runner = threading.Thread(target=worker.run)
    with completion_statements(queue) as completions:
        runner.start()
        try:
            assert quick_returned.wait(30), "the quick task ran"
            # Its success waits for the long task, well within the delay.
            assert {t.status for t in rows(engine)} == {tq.TaskStatus.RUNNING}
        finally:
            long_may_end.set()
            runner.join(timeout=60)
    assert not runner.is_alive()
    assert sorted(t.result for t in rows(engine)) == ["long", "quick"]
    if queue.strategy.name != "advisory_lock":  # each advisory task releases its own lock
        assert len(completions) == 1, completions


def claims_from_the_loop_only(queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch) -> None:
    """No write of successes claims too: the worker's loop claims for every slot, ahead of writes if it can.

    (Where the strategy commits a completion and a claim at once, a write of
    a whole batch's successes claims the next batch with it; the loop's
    claims ahead, and a lone slot's own claims, are for the writes that do not.)
    """
    monkeypatch.setattr(queue.strategy, "completes_and_claims_at_once", lambda _dialect: False)


def hold_success_writes(
    queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    """Hold every write of successes until the second event is set; the first is set once one is held."""
    writing, write_may_go = threading.Event(), threading.Event()
    real_complete_many = queue.complete_many

    def held_write(claimed: list[tq.ClaimedTask], results: object = None) -> set[int]:
        writing.set()
        write_may_go.wait(60)
        return real_complete_many(claimed, results)  # type: ignore[arg-type]

    monkeypatch.setattr(queue, "complete_many", held_write)
    return writing, write_may_go


@pytest.mark.requires("claims_ahead")
def test_a_task_claimed_ahead_is_given_back_unstarted_when_the_worker_stops(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    writing, write_may_go = hold_success_writes(queue, monkeypatch)
    with Session(engine) as session:
        first = queue.enqueue(session, "record", {"key": 1}, priority=0)
        session.commit()
        first_id = first.id
    # A success hook is called once the success is written, so the slot's
    # thread waits for the write: the task claimed ahead waits for the thread.
    worker = tq.Worker(queue, concurrency=1, poll_interval=0.05, on_success=lambda _task, _result: None)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert writing.wait(30), "the first task's success is being written"
        with Session(engine) as session:
            second = queue.enqueue(session, "record", {"key": 2})
            session.commit()
            second_id = second.id
        # The worker claims the next task for the slot still writing.
        wait_until(lambda: task_row(engine, second_id).status == tq.TaskStatus.RUNNING, 30, "a claim ahead")
        worker.stop()
    finally:
        write_may_go.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert task_row(engine, first_id).status == tq.TaskStatus.COMPLETED
    second_row = task_row(engine, second_id)
    assert (second_row.status, second_row.attempts) == (tq.TaskStatus.QUEUED, 0)
    assert executions(engine) == {1: 1}, "the task claimed ahead never started"
    assert worker.given_back == 1


@pytest.mark.requires("claims_ahead")
def test_a_task_claimed_ahead_and_still_waiting_at_the_shutdown_timeout_is_given_back_and_never_starts(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The write of the first task's success outlasts the stop altogether, so
    # the worker returns while the slot's thread is still in it, with the task
    # claimed ahead still waiting for that thread.
    claims_from_the_loop_only(queue, monkeypatch)
    monkeypatch.setattr(worker_module, "CLOSE_TIMEOUT", 0.2)
    writing, write_may_go = hold_success_writes(queue, monkeypatch)
    with Session(engine) as session:
        first_id = queue.enqueue(session, "record", {"key": 1}).id
        session.commit()
    worker = tq.Worker(
        queue, concurrency=1, poll_interval=0.05, shutdown_timeout=0.2, on_success=lambda _task, _result: None
    )
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert writing.wait(30), "the first task's success is being written"
        with Session(engine) as session:
            second_id = queue.enqueue(session, "record", {"key": 2}).id
            session.commit()
        wait_until(lambda: task_row(engine, second_id).status == tq.TaskStatus.RUNNING, 30, "a claim ahead")
        worker.stop()
        runner.join(timeout=60)
        assert not runner.is_alive(), "the worker returned with the write still held"
        second_row = task_row(engine, second_id)
        assert (second_row.status, second_row.attempts) == (tq.TaskStatus.QUEUED, 0), "given back at once"
        assert worker.given_back == 1
        held = [slot.task.id for slot in worker._running.values()]
        assert held == [first_id], "the slot of the task given back is free; the one writing is not"
    finally:
        write_may_go.set()
    # The slot's thread, free at last, ends rather than start the task it was to run.
    wait_until(lambda: task_row(engine, first_id).status == tq.TaskStatus.COMPLETED, 30, "the held write")
    slot_threads = [thread for thread in threading.enumerate() if thread.name.startswith("sa_taskqueue-task")]
    for thread in slot_threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in slot_threads)
    assert worker._running == {}
    assert executions(engine) == {1: 1}, "the task given back never started"
    second_row = task_row(engine, second_id)
    assert (second_row.status, second_row.attempts) == (tq.TaskStatus.QUEUED, 0)


def test_a_task_claimed_for_a_free_slot_runs_though_a_stop_comes_before_its_thread_takes_it_up(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Session(engine) as session:
        task_id = queue.enqueue(session, "record", {"key": 1}).id
        session.commit()
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05)
    real_claim = queue.claim

    def claim_then_stop(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        # The stop arrives once the task is claimed, shown as running, and
        # before any thread of the worker has taken it up.
        claimed = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        if claimed:
            worker.stop()
        return claimed

    monkeypatch.setattr(queue, "claim", claim_then_stop)
    worker.run()
    row = task_row(engine, task_id)
    assert (row.status, row.attempts) == (tq.TaskStatus.COMPLETED, 1)
    assert executions(engine) == {1: 1}
    assert (worker.processed, worker.given_back) == (1, 0)


def claims_on_threads(queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each claim the queue makes from now on: the thread that sent it, and how many tasks it took."""
    seen: list[tuple[str, int]] = []
    real_claim = queue.claim

    def claim(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        claimed = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        seen.append((threading.current_thread().name, len(claimed)))
        return claimed

    monkeypatch.setattr(queue, "claim", claim)
    return seen


@pytest.mark.backends("sqlite", "mysql", "mariadb")  # (PostgreSQL claims during the write instead)
def test_a_lone_slot_claims_its_next_task_on_its_own_thread_once_its_success_is_written(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(10)])
        session.commit()
    claims = claims_on_threads(queue, monkeypatch)
    started_on: list[str] = []
    unwritten_at_start: list[int] = []

    def on_start(task: tq.ClaimedTask) -> None:
        started_on.append(threading.current_thread().name)
        unwritten_at_start.append(sum(1 for t in rows(engine) if t.status == tq.TaskStatus.RUNNING) - 1)

    worker = queue.run_worker(concurrency=1, burst=True, poll_interval=0.05, on_start=on_start)
    assert (worker.processed, worker.failed) == (10, 0)
    assert executions(engine) == dict.fromkeys(range(10), 1)
    [slot_thread] = set(started_on)
    assert unwritten_at_start == [0] * 10, "each task starts once the one before it is written"
    taking = [thread for thread, count in claims if count]
    assert taking[0] == threading.current_thread().name, "the first claim is the loop's"
    assert taking[1:] == [slot_thread] * 9, "the rest are the slot's own"
    assert all(count <= 1 for _, count in claims)


@pytest.mark.backends("sqlite", "mysql", "mariadb")
def test_a_task_the_lone_slot_claims_as_a_stop_comes_runs_and_nothing_more_is_claimed(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(5)])
        session.commit()
    worker = tq.Worker(queue, concurrency=1, burst=True, poll_interval=0.05)
    real_claim = queue.claim
    claims: list[int] = []

    def claim_then_stop(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        # The stop arrives while the slot's own claim is on its way: what it
        # claimed is running already, as any claim for a free slot is.
        claimed = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        claims.append(len(claimed))
        if threading.current_thread() is not threading.main_thread():
            worker.stop()
        return claimed

    monkeypatch.setattr(queue, "claim", claim_then_stop)
    worker.run()
    assert claims == [1, 1], "the loop's claim, then the slot's, and none once stopped"
    assert (worker.processed, worker.given_back, worker.abandoned) == (2, 0, 0)
    assert executions(engine) == {0: 1, 1: 1}
    assert sorted(t.status for t in rows(engine)).count(tq.TaskStatus.QUEUED) == 3


@pytest.mark.backends("sqlite", "mysql", "mariadb")
def test_a_task_the_lone_slot_claims_after_the_shutdown_timeout_is_given_back_and_never_starts(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    with Session(engine) as session:
        first_id, second_id = (queue.enqueue(session, "record", {"key": n}).id for n in (1, 2))
        session.commit()
    worker = tq.Worker(queue, concurrency=1, burst=True, poll_interval=0.05, shutdown_timeout=0.2)
    real_claim = queue.claim
    claim_may_return = threading.Event()

    def slow_slot_claim(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        # The slot's own claim takes the second task, then its reply is held
        # until the worker has returned, its shutdown timeout long over.
        claimed = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        if threading.current_thread() is not threading.main_thread():
            worker.stop()
            assert claim_may_return.wait(60)
        return claimed

    monkeypatch.setattr(queue, "claim", slow_slot_claim)
    try:
        worker.run()
        assert task_row(engine, second_id).status == tq.TaskStatus.RUNNING, "claimed, its reply held"
        assert worker.abandoned == 1, "the slot's thread, still in its claim, is counted as busy"
    finally:
        claim_may_return.set()
    wait_until(lambda: task_row(engine, second_id).status == tq.TaskStatus.QUEUED, 30, "the task given back")
    assert task_row(engine, second_id).attempts == 0, "given back, the attempt not counted"
    assert task_row(engine, first_id).status == tq.TaskStatus.COMPLETED
    assert executions(engine) == {1: 1}, "the task given back never started"
    assert worker._running == {}


@pytest.mark.requires("claims_ahead")
def test_of_one_claim_a_stop_starts_the_task_for_the_free_slot_and_gives_back_the_one_claimed_ahead(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    writing, write_may_go = hold_success_writes(queue, monkeypatch)
    with Session(engine) as session:
        queue.enqueue(session, "record", {"key": 1})
        session.commit()
    real_claim = queue.claim
    armed = False
    arming = threading.Lock()  # held through each claim made before arming

    def claim_then_stop(*args: object, **kwargs: object) -> list[tq.ClaimedTask]:
        with arming:
            if not armed:
                return real_claim(*args, **kwargs)  # type: ignore[arg-type]
        if kwargs["limit"] != 2:
            return []  # sized before the write began: the next claim counts the slot writing
        claimed = real_claim(*args, **kwargs)  # type: ignore[arg-type]
        if claimed:
            worker.stop()  # before any thread has taken up what was claimed
        return claimed

    monkeypatch.setattr(queue, "claim", claim_then_stop)
    # With a success hook a slot's thread waits for its write: while the
    # first task's is held, one slot is free and one is writing.
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, on_success=lambda _task, _result: None)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert writing.wait(30), "the first task's success is being written"
        with arming:  # a claim already under way ends before the next tasks exist
            armed = True
        # Both due before either is enqueued: a claim that reads its clock
        # between the two enqueues, and its rows after their commit, takes
        # both all the same.
        due = datetime.now(UTC) - timedelta(seconds=1)
        with Session(engine) as session:
            ids = [queue.enqueue(session, "record", {"key": key}, run_at=due).id for key in (2, 3)]
            session.commit()
        # One claim takes both: one for the free slot, one ahead for the slot writing.
        wait_until(lambda: len(executions(engine)) == 2, 30, "the free slot's task to run")
    finally:
        write_may_go.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    outcomes = sorted((row.status, row.attempts) for row in rows(engine) if row.id in ids)
    assert outcomes == [(tq.TaskStatus.COMPLETED, 1), (tq.TaskStatus.QUEUED, 0)]
    assert sorted(executions(engine).values()) == [1, 1], "each task that started ran once"
    assert worker.given_back == 1


def test_a_slot_freed_while_another_of_its_batch_still_runs_waits_for_it_and_they_claim_together(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "long" and "quick" are claimed together; quick's success is written
    # alone once the completion delay is over, long still running, and long
    # ends as that write is sent.  Quick's slot waits, up to the delay again,
    # for long's: the next two tasks come in one claim, not one claim for
    # each slot.
    claims_from_the_loop_only(queue, monkeypatch)
    long_may_end, _ = long_and_quick_tasks(queue)
    with Session(engine) as session:
        queue.enqueue(session, "long", {})
        queue.enqueue(session, "quick", {})
        queue.enqueue_many(session, "quick", [{}, {}], priority=1)
        session.commit()
    claims = claims_on_threads(queue, monkeypatch)
    real_complete_many = queue.complete_many

    def complete_many(claimed: list[tq.ClaimedTask], results: object = None) -> set[int]:
        long_may_end.set()  # (its lone success goes first; long ends during its write)
        return real_complete_many(claimed, results)  # type: ignore[arg-type]

    monkeypatch.setattr(queue, "complete_many", complete_many)
    worker = tq.Worker(queue, concurrency=2, burst=True, poll_interval=0.05, completion_delay=1.0)
    runner = threading.Thread(target=worker.run)
    runner.start()
    runner.join(timeout=60)
    long_may_end.set()
    assert not runner.is_alive()
    assert worker.processed == 4
    assert [size for _thread, size in claims if size] == [2, 2]


@pytest.mark.requires("claims_ahead")  # (the next claim is sent during the write)
def test_a_long_task_of_an_older_claim_holds_up_no_claim_for_the_other_slots(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "long" holds one slot; quick tasks pass through the other.  A quick
    # success waits out the completion delay for long, as successes do; the
    # next quick task is then claimed as that success is written, not after
    # waiting a second delay for long, which came in an older claim.
    claims_from_the_loop_only(queue, monkeypatch)
    long_may_end, _ = long_and_quick_tasks(queue)
    with Session(engine) as session:
        queue.enqueue(session, "long", {})
        session.commit()
    claims = claims_on_threads(queue, monkeypatch)
    writing, write_may_go = hold_success_writes(queue, monkeypatch)
    delay = 2.0
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, completion_delay=delay)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: [s for _t, s in claims if s] == [1], 30, "long claimed alone")
        with Session(engine) as session:
            queue.enqueue_many(session, "quick", [{}, {}])
            session.commit()
        wait_until(lambda: [s for _t, s in claims if s] == [1, 1], 30, "the first quick task claimed")
        assert writing.wait(30), "its success is being written, after the delay"
        # Held in its write: the claim for its slot comes now, within half the
        # delay that waiting for long would have cost first.
        wait_until(
            lambda: [s for _t, s in claims if s] == [1, 1, 1],
            delay / 2,
            "the second quick task, claimed during the write",
        )
    finally:
        write_may_go.set()
        long_may_end.set()
        worker.stop()
        runner.join(timeout=30)
    assert not runner.is_alive()


@pytest.mark.requires("claims_ahead")
def test_a_slot_whose_success_another_slot_writes_runs_a_task_claimed_ahead_meanwhile(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims_from_the_loop_only(queue, monkeypatch)
    writing, write_may_go = hold_success_writes(queue, monkeypatch)
    with Session(engine) as session:
        batch = queue.enqueue_many(session, "record", [{"key": 1}, {"key": 2}])
        session.commit()
        batch_ids = list(batch)
    # The batch's last success writes both; the other slot's thread, with no
    # hook to call after the write, has moved on.
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, completion_delay=600)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert writing.wait(30), "the batch's successes are being written"
        with Session(engine) as session:
            queue.enqueue(session, "record", {"key": 3})
            session.commit()
        wait_until(lambda: 3 in executions(engine), 30, "the task claimed ahead to run")
        assert {task_row(engine, i).status for i in batch_ids} == {tq.TaskStatus.RUNNING}, "not written yet"
        write_may_go.set()
        done = {tq.TaskStatus.COMPLETED}
        wait_until(lambda: {t.status for t in rows(engine)} == done, 30, "every success written")
        worker.stop()
    finally:
        write_may_go.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert executions(engine) == {1: 1, 2: 1, 3: 1}
    assert (worker.processed, worker.given_back) == (3, 0)


def statements_completing_and_claiming(queue: tq.TaskQueue) -> AbstractContextManager[list[str]]:
    """The statements the queue sends meanwhile that complete tasks and claim others at once."""
    return statements_sent(queue, lambda sql: "finished_rows" in sql and "claimable" in sql)


def writes_claiming(queue: tq.TaskQueue, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tasks each write of successes that claims too claims, from now on."""
    seen: list[int] = []
    real_write = queue.complete_many_and_claim

    def write(*args: object, **kwargs: object) -> tuple[set[int], list[tq.ClaimedTask]]:
        written, claimed = real_write(*args, **kwargs)  # type: ignore[arg-type]
        seen.append(len(claimed))
        return written, claimed

    monkeypatch.setattr(queue, "complete_many_and_claim", write)
    return seen


def test_the_write_of_a_batch_claims_the_next_batch_where_the_database_commits_both_at_once(
    queue: tq.TaskQueue,
    engine: sa.Engine,
    backend: Backend,
    strategy_name: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with Session(engine) as session:
        queue.enqueue_many(session, "record", [{"key": n} for n in range(30)])
        session.commit()
    # The tasks the worker holds as each starts: its slots' and, claimed
    # ahead, at most as many again for slots whose outcome is being written.
    # (Each success waits for the rest of its batch, so that no batch splits.)
    held_at_start: list[int] = []
    worker = tq.Worker(queue, concurrency=3, burst=True, poll_interval=0.05, completion_delay=600)
    worker.on_start = lambda _task: held_at_start.append(len(worker._running))
    claimed_by_writes = writes_claiming(queue, monkeypatch)
    with statements_completing_and_claiming(queue) as both:
        worker.run()
    assert (worker.processed, worker.failed) == (30, 0)
    assert max(held_at_start) <= 2 * 3
    assert executions(engine) == dict.fromkeys(range(30), 1)
    assert {(t.status, t.attempts) for t in rows(engine)} == {(tq.TaskStatus.COMPLETED, 1)}
    if queue.strategy.completes_and_claims_at_once(queue.engine.dialect):
        assert sum(claimed_by_writes) > 0, "no write of successes claimed the next tasks"
    else:
        assert claimed_by_writes == [], "completions and claims go apart here"
    # On PostgreSQL the two are one statement; elsewhere two, in one transaction.
    assert bool(both) is (backend.is_postgres and strategy_name == "skip_locked"), both


@pytest.mark.backends("sqlite", "mysql", "mariadb")  # (PostgreSQL claims during the write)
def test_where_slots_claim_once_free_a_write_claims_for_its_slots_once_no_task_of_its_claim_runs(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_may_end, _ = long_and_quick_tasks(queue)
    with Session(engine) as session:
        long_id = queue.enqueue(session, "long", {}, priority=0).id
        queue.enqueue_many(session, "quick", [{}] * 6, priority=1)
        session.commit()
    claimed_by_writes = writes_claiming(queue, monkeypatch)
    worker = tq.Worker(queue, concurrency=2, burst=True, poll_interval=0.05)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: worker.processed == 6, 60, "the quick tasks to run beside the long one")
        assert task_row(engine, long_id).status == tq.TaskStatus.RUNNING
    finally:
        long_may_end.set()
        runner.join(timeout=60)
    assert not runner.is_alive()
    assert {(t.status, t.attempts) for t in rows(engine)} == {(tq.TaskStatus.COMPLETED, 1)}
    if queue.strategy.completes_and_claims_at_once(queue.engine.dialect):
        # The first claim took the long task and a quick one.  The quick
        # one's write claims nothing, the long task of its claim still
        # running: the loop claims for its slot once the completion delay
        # is out.  The long task, of an older claim from then on, holds up
        # no write: each later quick task came with the write of the one
        # before it.
        assert sum(claimed_by_writes) == 4, claimed_by_writes
    else:
        assert claimed_by_writes == []


@pytest.mark.requires("limit_with_for_update")  # (where skip_locked commits both at once)
def test_a_task_claimed_with_a_write_is_given_back_unstarted_when_the_worker_stops(
    engine: sa.Engine, lease: timedelta, monkeypatch: pytest.MonkeyPatch, backend: Backend
) -> None:
    # (With the strategy that commits both at once on this database.)
    queue = make_queue(engine, "conditional_update" if backend.is_sqlite else "skip_locked", lease)
    with Session(engine) as session:
        first_id = queue.enqueue(session, "record", {"key": 1}, priority=0).id
        second_id = queue.enqueue(session, "record", {"key": 2}, priority=1).id
        session.commit()
    claimed_with_write, write_may_return = threading.Event(), threading.Event()
    real_write = queue.complete_many_and_claim

    def held_once_sent(claimed: list[tq.ClaimedTask], results: object = None, **claim: object) -> object:
        outcome = real_write(claimed, results, **claim)  # type: ignore[arg-type]
        claimed_with_write.set()
        write_may_return.wait(60)
        return outcome

    monkeypatch.setattr(queue, "complete_many_and_claim", held_once_sent)
    # One slot, and a success hook: the slot's thread waits for its write,
    # and the task that write claimed waits for the thread.
    worker = tq.Worker(queue, concurrency=1, poll_interval=0.05, on_success=lambda _task, _result: None)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        assert claimed_with_write.wait(30), "the first task's success was written with a claim"
        assert task_row(engine, first_id).status == tq.TaskStatus.COMPLETED
        assert task_row(engine, second_id).status == tq.TaskStatus.RUNNING, "claimed by the same write"
        worker.stop()
    finally:
        write_may_return.set()
        runner.join(timeout=60)
        queue.close()
    assert not runner.is_alive()
    second_row = task_row(engine, second_id)
    assert (second_row.status, second_row.attempts) == (tq.TaskStatus.QUEUED, 0), "given back at once"
    assert executions(engine) == {1: 1}, "the task claimed with the write never started"
    assert worker.given_back == 1


@pytest.mark.backends("postgres")
def test_a_result_the_database_refuses_fails_its_task_and_claims_nothing_with_the_others(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    # JSON holds a NUL character; PostgreSQL's jsonb refuses it, so the
    # batch's write fails at the database, and any claim sent with it is
    # rolled back with it: the tasks it would have claimed are claimed again.
    @queue.task(name="nul_result", max_attempts=1)
    def nul_result() -> str:
        return "a\x00b"

    with Session(engine) as session:
        queue.enqueue(session, "nul_result", priority=0)
        queue.enqueue_many(session, "record", [{"key": n} for n in range(6)], priority=1)
        session.commit()
    with statements_completing_and_claiming(queue) as both:
        worker = queue.run_worker(concurrency=2, burst=True, poll_interval=0.05, completion_delay=600)
    if queue.strategy.name == "skip_locked":
        assert both, "the refused result went in a write that claimed too"
    assert executions(engine) == dict.fromkeys(range(6), 1)
    by_status: dict[tq.TaskStatus, list[str]] = {}
    for task in rows(engine):
        by_status.setdefault(task.status, []).append(task.name)
        assert task.attempts == 1
    assert by_status == {tq.TaskStatus.FAILED: ["nul_result"], tq.TaskStatus.COMPLETED: ["record"] * 6}
    assert worker.processed + worker.failed == 7


def test_at_the_shutdown_timeout_a_finished_task_is_completed_and_only_the_running_one_given_back(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    long_may_end, _ = long_and_quick_tasks(queue)
    with Session(engine) as session:
        long = queue.enqueue(session, "long", {})
        quick = queue.enqueue(session, "quick", {})
        session.commit()
        long_id, quick_id = long.id, quick.id
    # The quick success waits for the long task (well within the delay) when the stop comes.
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, completion_delay=600, shutdown_timeout=0.2)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        wait_until(lambda: worker.processed == 1, 30, "the quick task to finish")
        assert task_row(engine, quick_id).status == tq.TaskStatus.RUNNING, "its success waits for the batch"
        worker.stop()
        runner.join(timeout=60)
        assert not runner.is_alive()
    finally:
        long_may_end.set()
    assert task_row(engine, quick_id).status == tq.TaskStatus.COMPLETED
    long_row = task_row(engine, long_id)
    assert (long_row.status, long_row.attempts) == (tq.TaskStatus.QUEUED, 0)
    assert (worker.given_back, worker.abandoned) == (1, 1)


@pytest.mark.parametrize("delay", [-0.001, float("nan"), float("inf"), "0.005", None, True])
def test_a_completion_delay_that_is_not_a_number_of_seconds_is_refused(
    queue: tq.TaskQueue, delay: object
) -> None:
    with pytest.raises(ValueError, match="completion_delay"):
        tq.Worker(queue, completion_delay=delay)  # type: ignore[arg-type]


def test_a_batch_write_that_fails_falls_back_to_one_write_per_task(
    queue: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots = 3
    enqueue_tasks_finishing_together(queue, engine, slots)
    calls: list[int] = []

    def fails_once(write: Any) -> Any:
        # Whichever the worker sends: the successes alone, or with its next claim.
        def first_fails(claimed: list[tq.ClaimedTask], results: object = None, **claim: object) -> object:
            calls.append(len(claimed))
            if len(calls) == 1:
                raise RuntimeError("injected: the first batch write fails")
            return write(claimed, results, **claim)

        return first_fails

    monkeypatch.setattr(queue, "complete_many", fails_once(queue.complete_many))
    monkeypatch.setattr(queue, "complete_many_and_claim", fails_once(queue.complete_many_and_claim))
    done: list[tq.Worker] = []
    runner = threading.Thread(
        target=lambda: done.append(queue.run_worker(concurrency=slots, burst=True, poll_interval=0.05))
    )
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "slots waited for ever on completions a failed write left behind"
    assert calls, "the injected failure fired: a batch write failed"
    assert (done[0].processed, done[0].failed) == (slots, 0)
    assert {(t.status, t.result) for t in rows(engine)} == {
        (tq.TaskStatus.COMPLETED, n) for n in range(slots)
    }


def test_a_slow_success_hook_does_not_hold_up_claims_for_free_slots(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    in_hook = threading.Event()
    hook_may_return = threading.Event()
    hook_returned = threading.Event()
    started_during_hook: list[bool] = []
    second_started = threading.Event()

    def on_start(task: tq.ClaimedTask) -> None:
        if task.params["key"] == 1:
            started_during_hook.append(not hook_returned.is_set())
            second_started.set()

    def on_success(task: tq.ClaimedTask, _result: object) -> None:
        if task.params["key"] == 0:
            in_hook.set()
            hook_may_return.wait(120)  # a slow metrics call, say: it lasts until task 1 has started
            hook_returned.set()

    worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, on_start=on_start, on_success=on_success)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        with Session(engine) as session:
            queue.enqueue(session, "record", {"key": 0})
            session.commit()
        assert in_hook.wait(30), "task 0 finished and its slot is in the slow hook"
        with Session(engine) as session:
            queue.enqueue(session, "record", {"key": 1})
            session.commit()
        second_started.wait(30)
    finally:
        hook_may_return.set()
        worker.stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert started_during_hook == [True], "the free slot waited for the other's hook"


def test_a_row_naming_unregistered_code_is_never_run_and_stays_queued_for_a_worker_that_knows_it(
    queue: tq.TaskQueue, engine: sa.Engine, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    with Session(engine) as session:
        # Written straight into the table, as an attacker or a newer release might.
        session.add(tq.Task(name="os.system", params={"command": f"touch {marker}"}, max_attempts=1))
        session.add(tq.Task(name="subprocess.run", params={"args": ["touch", str(marker)]}, max_attempts=1))
        queue.enqueue(session, "record", {"key": 1})
        session.commit()
    queue.run_worker(concurrency=2, burst=True, poll_interval=0.05)
    assert not marker.exists()
    by_name = {t.name: t for t in rows(engine)}
    assert by_name["record"].status == tq.TaskStatus.COMPLETED, "the worker went on"
    for name in ("os.system", "subprocess.run"):
        # Not claimed at all: no attempt burnt, nothing to fail.
        assert by_name[name].status == tq.TaskStatus.QUEUED
        assert by_name[name].attempts == 0
        assert by_name[name].last_error is None


def test_the_worker_retries_a_failing_task_then_marks_it_failed(
    engine: sa.Engine, strategy_name: str, lease: timedelta
) -> None:
    clock = MovableClock()
    queue = make_queue(engine, strategy_name, lease, clock.now)
    try:
        with Session(engine) as session:
            task_id = queue.enqueue(session, "boom", {"message": "always"}, max_attempts=3).id
            session.commit()
        for attempt in (1, 2, 3):
            # Each run is one attempt: the clock stands still, so the retry
            # it schedules is not due before the run returns.
            worker = queue.run_worker(burst=True, poll_interval=0.05)
            [task] = rows(engine)
            assert (worker.processed, worker.failed, task.attempts) == (0, 1, attempt)
            if attempt < 3:
                assert task.status == tq.TaskStatus.QUEUED and task.run_at > clock.now()
                clock.advance(task.run_at - clock.now())  # the retry comes due
    finally:
        queue.close()
    assert (task.id, task.status, task.attempts) == (task_id, tq.TaskStatus.FAILED, 3)
    assert "ValueError: always" in (task.last_error or "")


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_a_task_longer_than_its_lease_is_not_claimed_twice_while_its_worker_lives(
    engine: sa.Engine, strategy_name: str, lease: timedelta
) -> None:
    clock = MovableClock()
    queue = make_queue(engine, strategy_name, lease, clock.now)
    rival = make_queue(engine, strategy_name, lease, clock.now)
    may_finish = threading.Event()

    @queue.task(name="long")
    def long(key: int) -> int:
        may_finish.wait(120)  # runs until the test has moved the clock past several leases
        record = queue.registered("record")
        assert record is not None
        return int(record.func(key=key))

    with Session(engine) as session:
        queue.enqueue(session, "long", {"key": 1})
        session.commit()
    worker = threading.Thread(target=queue.run_worker, kwargs={"burst": True, "poll_interval": 0.05})
    worker.start()
    stolen: list[tq.ClaimedTask] = []

    def renewed_past(until: datetime) -> Callable[[], bool]:
        def renewed() -> bool:
            lease_end = rows(engine)[0].locked_until
            return lease_end is not None and lease_end >= until

        return renewed

    try:
        wait_until(lambda: rows(engine)[0].status == tq.TaskStatus.RUNNING, 30, "the task to start")
        first_lease_end = rows(engine)[0].locked_until
        assert first_lease_end is not None
        latest_lease_end = first_lease_end
        for _ in range(5):  # 2.5 leases in all
            clock.advance(lease / 2)
            # Each step the rival's claim runs a recovery pass first: without
            # the last renewal the lease would have run out by the third.
            stolen.extend(rival.claim(worker_id="rival"))
            wait_until(renewed_past(clock.now() + lease), 30, "the heartbeat to renew the lease")
            latest_lease_end = rows(engine)[0].locked_until or latest_lease_end
            stolen.extend(rival.claim(worker_id="rival"))
    finally:
        may_finish.set()
        worker.join(timeout=60)
        rival.close()
        queue.close()
    assert not worker.is_alive()
    assert stolen == [], "the heartbeat kept the lease"
    assert latest_lease_end > first_lease_end + lease, "the heartbeat renewed the lease more than once"
    assert executions(engine) == {1: 1}
    [task] = rows(engine)
    assert (task.status, task.attempts) == (tq.TaskStatus.COMPLETED, 1)


def test_a_result_the_database_refuses_fails_the_task_and_frees_it(
    queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str
) -> None:
    @queue.task(name="not_a_number", max_attempts=1)
    def not_a_number() -> float:
        return float("nan")  # not JSON: no database stores it

    with Session(engine) as session:
        queue.enqueue(session, "not_a_number")
        queue.enqueue(session, "record", {"key": 1})
        session.commit()
    succeeded: list[str] = []
    failed: list[tuple[str, str]] = []
    worker = queue.run_worker(
        concurrency=2,
        burst=True,
        poll_interval=0.05,
        on_success=lambda task, _result: succeeded.append(task.name),
        on_failure=lambda task, error: failed.append((task.name, type(error).__name__)),
    )
    # It failed, as far as the worker's counts and hooks go too.
    assert (worker.processed, worker.failed) == (1, 1)
    assert (succeeded, failed) == (["record"], [("not_a_number", "TypeError")])
    by_name = {t.name: t for t in rows(engine)}
    assert by_name["not_a_number"].status == tq.TaskStatus.FAILED
    assert "JSON" in (by_name["not_a_number"].last_error or "")
    assert by_name["record"].status == tq.TaskStatus.COMPLETED
    assert {t.status for t in rows(engine)} == {tq.TaskStatus.FAILED, tq.TaskStatus.COMPLETED}
    if strategy_name == "advisory_lock":
        # And no lock is left behind on either task.
        from sa_taskqueue.strategies.advisory import AdvisoryLocks

        locks = AdvisoryLocks(engine, tq.Task.__table__)
        ids = [t.id for t in rows(engine)]
        with engine.connect() as other:
            assert locks.try_lock(other, ids) == ids
            locks.unlock(other, ids)
