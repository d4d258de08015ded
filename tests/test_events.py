"""The worker's lifecycle events: emitted once each fact is true, heard by subscribers, hooks, log lines."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.core.events import EventKind, TaskEvent, WorkerEvent
from tests.helpers import enqueue_one, task_row, wait_until

TASK_KINDS = [EventKind.CLAIMED, EventKind.STARTED, EventKind.SUCCEEDED, EventKind.FAILED, EventKind.RETRIED]


def burst(queue: tq.TaskQueue, **options: Any) -> tq.Worker:
    worker = tq.Worker(queue, burst=True, watchdog=False, poll_interval=0.05, **options)
    worker.run()
    return worker


@contextmanager
def running(worker: tq.Worker) -> Iterator[tq.Worker]:
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert not thread.is_alive()


def test_a_task_that_succeeds_is_claimed_started_and_succeeded_in_that_order(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    task_id = enqueue_one(queue, engine, "record", {"key": 7})
    heard: list[TaskEvent] = []
    status_when_succeeded: list[tq.TaskStatus] = []

    def hear(event: TaskEvent) -> None:
        heard.append(event)
        if event.kind is EventKind.SUCCEEDED:
            # On a connection of its own: the success is committed before the event.
            status_when_succeeded.append(task_row(engine, event.task_id).status)

    unsubscribe = queue.events.subscribe(hear, TASK_KINDS)
    try:
        worker = burst(queue)
    finally:
        unsubscribe()
    assert [event.kind for event in heard] == [EventKind.CLAIMED, EventKind.STARTED, EventKind.SUCCEEDED]
    assert status_when_succeeded == [tq.TaskStatus.COMPLETED]
    for event in heard:
        assert (event.task_id, event.task_name, event.queue, event.attempt) == (
            task_id,
            "record",
            "default",
            1,
        )
        assert event.worker_id == worker.worker_id
        assert event.task is not None and event.task.id == task_id
    succeeded = heard[-1]
    assert succeeded.result == 7
    assert succeeded.duration is not None and succeeded.duration >= 0
    assert heard[0].duration is None  # (a claim has no run yet)


def test_a_failing_task_is_retried_while_attempts_remain_then_failed(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    task_id = enqueue_one(default_queue, engine, "boom", {"message": "no"}, max_attempts=2)
    heard: list[TaskEvent] = []
    status_at: dict[EventKind, tq.TaskStatus] = {}

    def hear(event: TaskEvent) -> None:
        heard.append(event)
        status_at[event.kind] = task_row(engine, event.task_id).status

    unsubscribe = default_queue.events.subscribe(hear, [EventKind.FAILED, EventKind.RETRIED])
    try:
        with running(tq.Worker(default_queue, watchdog=False, poll_interval=0.05)):
            wait_until(lambda: len(heard) == 2, 30, "both attempts to fail")
    finally:
        unsubscribe()
    assert [(event.kind, event.attempt) for event in heard] == [(EventKind.RETRIED, 1), (EventKind.FAILED, 2)]
    assert status_at == {EventKind.RETRIED: tq.TaskStatus.QUEUED, EventKind.FAILED: tq.TaskStatus.FAILED}
    assert all(isinstance(event.error, ValueError) and str(event.error) == "no" for event in heard)
    assert all(event.duration is not None for event in heard)
    assert task_row(engine, task_id).status == tq.TaskStatus.FAILED


def test_a_worker_tells_when_it_starts_and_stops(default_queue: tq.TaskQueue, engine: sa.Engine) -> None:
    enqueue_one(default_queue, engine, "record", {"key": 1})
    heard: list[WorkerEvent] = []
    unsubscribe = default_queue.events.subscribe(
        heard.append, [EventKind.WORKER_STARTED, EventKind.WORKER_STOPPED]
    )
    try:
        worker = burst(default_queue)
    finally:
        unsubscribe()
    assert [event.kind for event in heard] == [EventKind.WORKER_STARTED, EventKind.WORKER_STOPPED]
    assert all(event.worker_id == worker.worker_id for event in heard)
    assert heard[0].counts["processed"] == 0
    assert heard[1].counts == {"processed": 1, "failed": 0, "given_back": 0}


def test_a_subscriber_that_raises_is_logged_and_the_worker_and_other_subscribers_carry_on(
    default_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    ids = [enqueue_one(default_queue, engine, "record", {"key": key}) for key in range(3)]

    def broken(_event: TaskEvent) -> None:
        raise RuntimeError("broken exporter")

    heard: list[int] = []
    unsubscribe = [
        default_queue.events.subscribe(broken, [EventKind.SUCCEEDED]),
        default_queue.events.subscribe(lambda event: heard.append(event.task_id), [EventKind.SUCCEEDED]),
    ]
    try:
        with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
            worker = burst(default_queue)
    finally:
        for each in unsubscribe:
            each()
    assert sorted(heard) == ids
    assert worker.processed == 3
    assert all(task_row(engine, task_id).status == tq.TaskStatus.COMPLETED for task_id in ids)
    raised = [record for record in caplog.records if "an event subscriber (broken) raised" in record.message]
    assert len(raised) == 3


def test_an_unsubscribed_callback_hears_nothing_more(default_queue: tq.TaskQueue, engine: sa.Engine) -> None:
    heard: list[int] = []
    unsubscribe = default_queue.events.subscribe(
        lambda event: heard.append(event.task_id), [EventKind.STARTED]
    )
    first = enqueue_one(default_queue, engine, "record", {"key": 1})
    burst(default_queue)
    unsubscribe()
    assert not default_queue.events.wants(EventKind.STARTED) or heard == [first]
    enqueue_one(default_queue, engine, "record", {"key": 2})
    burst(default_queue)
    assert heard == [first]


def test_hooks_are_called_as_before_in_the_tasks_thread_after_the_outcome_is_written(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    good = enqueue_one(default_queue, engine, "record", {"key": 3})
    bad = enqueue_one(default_queue, engine, "boom", {"message": "bad"}, max_attempts=1)
    calls: list[tuple[str, int, Any]] = []
    threads: dict[str, set[str]] = {"start": set(), "success": set(), "failure": set()}
    statuses: dict[int, tq.TaskStatus] = {}

    def on_start(task: tq.ClaimedTask) -> None:
        calls.append(("start", task.id, None))
        threads["start"].add(threading.current_thread().name)

    def on_success(task: tq.ClaimedTask, result: Any) -> None:
        calls.append(("success", task.id, result))
        threads["success"].add(threading.current_thread().name)
        statuses[task.id] = task_row(engine, task.id).status

    def on_failure(task: tq.ClaimedTask, error: BaseException) -> None:
        calls.append(("failure", task.id, error))
        threads["failure"].add(threading.current_thread().name)
        statuses[task.id] = task_row(engine, task.id).status

    burst(default_queue, on_start=on_start, on_success=on_success, on_failure=on_failure)
    assert [call[:2] for call in calls if call[1] == good] == [("start", good), ("success", good)]
    assert [call[:2] for call in calls if call[1] == bad] == [("start", bad), ("failure", bad)]
    assert next(call[2] for call in calls if call[0] == "success") == 3
    failure = next(call[2] for call in calls if call[0] == "failure")
    assert isinstance(failure, ValueError) and str(failure) == "bad"
    assert statuses == {good: tq.TaskStatus.COMPLETED, bad: tq.TaskStatus.FAILED}
    assert all(name.startswith("sa_taskqueue-task") for names in threads.values() for name in names)
    # Subscribed for the run only.
    assert not default_queue.events.wants(EventKind.SUCCEEDED)


def test_a_hook_that_raises_is_logged_and_ignored(
    default_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    task_id = enqueue_one(default_queue, engine, "record", {"key": 1})

    def on_success(_task: tq.ClaimedTask, _result: Any) -> None:
        raise RuntimeError("hook trouble")

    with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
        worker = burst(default_queue, on_success=on_success)
    assert worker.processed == 1
    assert task_row(engine, task_id).status == tq.TaskStatus.COMPLETED
    assert [record.message for record in caplog.records if "hook raised" in record.message] == [
        "the on_success hook raised"
    ]


def test_the_task_log_lines_are_the_same_as_ever(
    default_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    good = enqueue_one(default_queue, engine, "record", {"key": 1})
    bad = enqueue_one(default_queue, engine, "boom", {"message": "bad"}, max_attempts=1)
    with caplog.at_level(logging.INFO, logger="sa_taskqueue"):
        worker = burst(default_queue)
    lines = {record.message: record for record in caplog.records}
    assert f"task {good} record attempt 1 started" in lines
    done = next(
        record
        for message, record in lines.items()
        if message.startswith(f"task {good} record attempt 1 done in ")
    )
    assert done.levelno == logging.INFO
    assert (done.task_id, done.task_name, done.worker_id) == (good, "record", worker.worker_id)  # type: ignore[attr-defined]
    assert done.duration_ms >= 0  # type: ignore[attr-defined]
    failed = next(
        record
        for message, record in lines.items()
        if message.startswith(f"task {bad} boom attempt 1 failed after ")
    )
    assert failed.levelno == logging.WARNING
    assert failed.message.endswith(": bad")
    assert failed.error == "bad"  # type: ignore[attr-defined]
    # One line each, however many workers a process runs.
    assert (
        sum(1 for record in caplog.records if record.message == f"task {good} record attempt 1 started") == 1
    )


def test_two_workers_of_one_process_hear_only_their_own_tasks_in_their_hooks(
    default_queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    first_hooks: list[int] = []
    second_hooks: list[int] = []
    first = tq.Worker(
        default_queue, watchdog=False, poll_interval=0.05, on_start=lambda task: first_hooks.append(task.id)
    )
    second = tq.Worker(
        default_queue, watchdog=False, poll_interval=0.05, on_start=lambda task: second_hooks.append(task.id)
    )
    ids = [enqueue_one(default_queue, engine, "record", {"key": key}) for key in range(6)]
    with running(first), running(second):
        wait_until(lambda: first.processed + second.processed == 6, 30, "every task to run")
    assert sorted(first_hooks + second_hooks) == ids
    assert len(first_hooks) == first.processed and len(second_hooks) == second.processed


def test_an_event_nobody_listens_for_is_never_built(
    default_queue: tq.TaskQueue,
    engine: sa.Engine,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    built: list[EventKind] = []
    real = TaskEvent.of

    def counted(kind: EventKind, *args: Any, **kwargs: Any) -> TaskEvent:
        built.append(kind)
        return real(kind, *args, **kwargs)

    monkeypatch.setattr(TaskEvent, "of", counted)
    enqueue_one(default_queue, engine, "record", {"key": 1})
    with caplog.at_level(logging.WARNING, logger="sa_taskqueue"):
        burst(default_queue)
    assert built == []  # (nobody subscribed, and the task lines are off)
    enqueue_one(default_queue, engine, "record", {"key": 2})
    with caplog.at_level(logging.INFO, logger="sa_taskqueue"):
        burst(default_queue)
    # The task lines are on: only the kinds they hear are built.
    assert built == [EventKind.STARTED, EventKind.SUCCEEDED]


def test_a_service_that_raises_is_logged_reported_and_restarted_never_stopping_the_others(
    default_queue: tq.TaskQueue, caplog: pytest.LogCaptureFixture
) -> None:
    from sa_taskqueue.worker.lifecycle import Emitter
    from sa_taskqueue.worker.services import ServiceRunner
    from sa_taskqueue.worker.slots import WorkerState

    class Flaky:
        name = "flaky"

        def __init__(self) -> None:
            self.runs = 0

        def run(self, stopping: threading.Event) -> None:
            self.runs += 1
            if self.runs == 1:
                raise RuntimeError("first run fails")
            stopping.wait()

        def interrupt(self) -> None:
            pass

    class Steady(Flaky):
        name = "steady"

        def run(self, stopping: threading.Event) -> None:
            self.runs += 1
            stopping.wait()

    errors: list[WorkerEvent] = []
    unsubscribe = default_queue.events.subscribe(errors.append, [EventKind.SERVICE_ERROR])
    flaky, steady = Flaky(), Steady()
    runner = ServiceRunner(Emitter(default_queue.events, WorkerState("w1")))
    try:
        with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
            runner.start([flaky, steady])
            wait_until(lambda: flaky.runs == 2, 10, "the failed service to be restarted")
    finally:
        runner.stop(timeout=5)
        unsubscribe()
    assert steady.runs == 1
    assert [(event.service, str(event.error)) for event in errors] == [("flaky", "first run fails")]
    assert any(record.message.startswith("the flaky service failed") for record in caplog.records)
    assert not any(thread.name.startswith("sa_taskqueue-flaky") for thread in threading.enumerate())


def test_a_statement_tracer_gets_an_execution_context_for_every_claim_and_completion(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    # What a tracer such as OpenTelemetry's SQLAlchemy instrumentation does:
    # it keeps its span on the execution context, before and after each statement.
    for key in range(20):
        enqueue_one(queue, engine, "record", {"key": key})
    traced: list[str] = []

    def before(_conn: object, _cursor: object, statement: str, _p: object, context: Any, *_: object) -> None:
        context._test_span = statement  # (an AttributeError on a missing context fails the worker)

    def after(_conn: object, _cursor: object, statement: str, _p: object, context: Any, *_: object) -> None:
        assert context._test_span == statement
        traced.append(statement)

    sa.event.listen(queue.engine, "before_cursor_execute", before)
    sa.event.listen(queue.engine, "after_cursor_execute", after)
    try:
        worker = burst(queue, concurrency=4)
    finally:
        sa.event.remove(queue.engine, "before_cursor_execute", before)
        sa.event.remove(queue.engine, "after_cursor_execute", after)
    assert worker.processed == 20 and worker.failed == 0
    updates = [statement for statement in traced if "UPDATE " + tq.Task.__table__.name in statement]
    assert updates, "the claims and completions were traced"
