"""Waiting for a task's result: `TaskQueue.result` and `result_async`, on every backend.

On PostgreSQL the wait is woken by the NOTIFY sent when the task finishes;
the tests prove it by giving the waiter a poll interval longer than the test
may last.  Elsewhere the same tests run with a short poll interval.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from sa_taskqueue.core.finished import finished_channel_name
from sa_taskqueue.core.notify import can_listen
from tests.backends import Backend
from tests.helpers import ROOT, cli_env, enqueue_one, listening, wait_until

#: Longer than any test here may wait: a waiter with it is woken by NOTIFY, or not at all.
NEVER = 3600.0


def notified(queue: tq.TaskQueue) -> bool:
    """Whether a finished task wakes this queue's waiters (PostgreSQL with psycopg)."""
    return can_listen(queue.engine)


def poll_interval(queue: tq.TaskQueue) -> float:
    return NEVER if notified(queue) else 0.05


def claim_one(queue: tq.TaskQueue) -> tq.ClaimedTask:
    found: list[tq.ClaimedTask] = []
    wait_until(lambda: found.extend(queue.claim(limit=1)) or found, 10, "a task to claim")
    return found[0]


class Waiter:
    """``wait()`` in a thread; its outcome (value or exception) once it returns."""

    def __init__(self, wait: Callable[[], Any]) -> None:
        self.outcome: list[Any] = []
        self.thread = threading.Thread(target=self._run, args=(wait,), daemon=True)
        self.thread.start()

    def _run(self, wait: Callable[[], Any]) -> None:
        try:
            self.outcome.append(wait())
        except BaseException as error:  # noqa: BLE001 - handed to the test
            self.outcome.append(error)

    def result(self, seconds: float = 15) -> Any:
        self.thread.join(seconds)
        assert self.outcome, f"the waiter did not return within {seconds}s"
        return self.outcome[0]


def parked(queue: tq.TaskQueue, count: int = 1) -> None:
    """Wait until ``count`` waiters sit in a pause only a notification ends (PostgreSQL), else return."""
    if notified(queue):
        wait_until(
            lambda: queue.finished_listener.parked >= count, 15, "the waiter to wait on its notification"
        )


def test_result_of_a_completed_task(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    task_id = enqueue_one(queue, engine, "record", {"key": 1})
    assert queue.complete(claim_one(queue), {"total": 3, "items": ["a", None]})
    assert queue.result(task_id, timeout=10) == {"total": 3, "items": ["a", None]}


def test_result_of_a_failed_task_raises_its_error(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    task_id = enqueue_one(queue, engine, "boom", {"message": "x"}, max_attempts=1)
    queue.fail(claim_one(queue), ValueError("the disk is full"))
    with pytest.raises(tq.TaskFailed) as raised:
        queue.result(task_id, timeout=10)
    error = raised.value
    assert isinstance(error, tq.TaskResultError)
    assert (error.task_id, error.status, error.attempts) == (task_id, "failed", 1)
    assert error.last_error is not None
    assert "the disk is full" in error.last_error
    assert "the disk is full" in str(error)


def test_result_of_a_cancelled_task_raises(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    task_id = enqueue_one(queue, engine, "record", {"key": 1})
    waiter = Waiter(lambda: queue.result(task_id, timeout=60, poll_interval=poll_interval(queue)))
    parked(queue)
    assert queue.cancel(task_id)
    error = waiter.result()
    assert isinstance(error, tq.TaskCancelled)
    assert (error.task_id, error.status) == (task_id, "cancelled")


def test_a_task_queued_again_to_retry_keeps_the_caller_waiting(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    task_id = enqueue_one(queue, engine, "boom", {"message": "x"}, max_attempts=2)
    queue.fail(claim_one(queue), ValueError("first attempt"))
    with pytest.raises(tq.ResultTimeout) as raised:
        queue.result(task_id, timeout=0.1)
    assert raised.value.status == "queued"
    waiter = Waiter(lambda: queue.result(task_id, timeout=60, poll_interval=poll_interval(queue)))
    retried = claim_one(queue)  # once its retry delay is over
    assert retried.attempts == 2
    assert not waiter.outcome
    parked(queue)
    assert queue.complete(retried, "second time lucky")
    assert waiter.result() == "second time lucky"


def test_a_timeout_raises_a_timeout_error_naming_the_task(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    task_id = enqueue_one(queue, engine, "record", {"key": 1})
    with pytest.raises(TimeoutError) as raised:
        queue.result(task_id, timeout=0.05)
    assert isinstance(raised.value, tq.ResultTimeout)
    assert raised.value.task_id == task_id
    assert raised.value.waited >= 0.05
    assert f"task {task_id} did not finish" in str(raised.value)


def test_an_unknown_task_raises_lookup_error(queue: tq.TaskQueue) -> None:
    with pytest.raises(LookupError) as raised:
        queue.result(123456789, timeout=5)
    assert isinstance(raised.value, tq.TaskNotFound)
    assert "123456789" in str(raised.value)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"task_id": 0}, "task_id"),
        ({"timeout": -1}, "timeout"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": float("inf")}, "poll_interval"),
        ({"poll_interval": 1e12}, "poll_interval"),
    ],
)
def test_bad_arguments_are_refused(queue: tq.TaskQueue, arguments: dict[str, Any], named: str) -> None:
    call = {"task_id": 1, "timeout": 1.0, **arguments}
    with pytest.raises(ValueError, match=named):
        queue.result(call.pop("task_id"), **call)


def test_a_waiter_wakes_when_another_connection_completes_the_task(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    """On PostgreSQL only the notification can end the wait in time: the waiter's poll interval is an hour."""
    task_ids = [enqueue_one(queue, engine, "record", {"key": n}) for n in range(3)]
    waiters = [
        Waiter(
            lambda task_id=task_id: queue.result(task_id, timeout=NEVER, poll_interval=poll_interval(queue))
        )
        for task_id in task_ids
    ]
    parked(queue, count=3)
    claimed = sorted(queue.claim(limit=3), key=lambda task: task.id)
    assert [task.id for task in claimed] == task_ids
    assert queue.complete_many(claimed, ["a", "b", "c"]) == set(task_ids)
    assert [waiter.result() for waiter in waiters] == ["a", "b", "c"]


@pytest.mark.requires("notify")
def test_a_wait_takes_no_connection_of_the_applications_pool_for_long(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    """The listener's LISTEN connection leaves the pool as soon as it is opened (PostgreSQL)."""
    small = sa.create_engine(engine.url, pool_size=1, max_overflow=0, pool_timeout=5)
    waiting = tq.TaskQueue(small, clock=queue.clock)
    try:
        task_id = enqueue_one(queue, engine, "record", {"key": 1})
        waiter = Waiter(lambda: waiting.result(task_id, timeout=NEVER, poll_interval=poll_interval(waiting)))
        parked(waiting)
        assert small.pool.checkedout() == 0  # type: ignore[attr-defined]
        with small.connect() as conn:  # the pool's one connection is the application's
            assert conn.execute(sa.select(1)).scalar_one() == 1
        assert queue.complete(claim_one(queue), "done")
        assert waiter.result() == "done"
    finally:
        waiting.close()
        small.dispose()


def test_closing_the_queue_sends_parked_waiters_back_to_polling(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    """After close, nothing announces a finish: a waiter parked on a notification must not sleep on."""
    task_id = enqueue_one(queue, engine, "record", {"key": 1})
    waiter = Waiter(lambda: queue.result(task_id, timeout=NEVER, poll_interval=poll_interval(queue)))
    parked(queue)
    queue.close()
    assert queue.complete(claim_one(queue), "done")
    assert waiter.result() == "done", "it polled again, its poll interval of an hour cut short"


@pytest.mark.requires("notify")
def test_only_the_tasks_waited_for_are_announced(
    queue: tq.TaskQueue, engine: sa.Engine, backend: Backend
) -> None:
    """A completion nobody waits for sends no NOTIFY (each would serialise commits); one waited for does.

    Notifications arrive in commit order, so a marker sent after a
    completion has committed tells, without a timed window, that the
    completion sent none.
    """
    channel = finished_channel_name(queue.table)
    alone, waited = (enqueue_one(queue, engine, "record", {"key": n}) for n in range(2))

    def announced_until_marker(listener: Any, marker: str) -> list[str]:
        with engine.connect() as conn:
            conn.execute(sa.select(sa.func.pg_notify(channel, marker)))
            conn.commit()
        payloads: list[str] = []
        for notification in listener.notifies(timeout=15):
            if notification.channel == channel:
                if notification.payload == marker:
                    return payloads
                payloads.append(notification.payload)
        raise AssertionError(f"the marker {marker!r} did not arrive")

    with listening(backend, queue.table) as listener:
        listener.execute(f'LISTEN "{channel}"')
        assert queue.complete(claim_one(queue), "nobody asked")
        assert announced_until_marker(listener, "marker-1") == []
        waiter = Waiter(lambda: queue.result(waited, timeout=NEVER, poll_interval=NEVER))
        parked(queue)
        assert queue.complete(claim_one(queue), "asked")
        assert waiter.result() == "asked"
        assert announced_until_marker(listener, "marker-2") == [str(waited)]
    assert queue.result(alone, timeout=0) == "nobody asked"


def test_the_async_twin(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    done_id = enqueue_one(queue, engine, "record", {"key": 1})
    failed_id = enqueue_one(queue, engine, "boom", {"message": "x"}, max_attempts=1)
    waiting_id = enqueue_one(queue, engine, "record", {"key": 2})
    queue.complete(claim_one(queue), [1, 2])
    queue.fail(claim_one(queue), ValueError("no luck"))

    async def main() -> Any:
        assert await queue.result_async(done_id, timeout=10) == [1, 2]
        with pytest.raises(tq.TaskFailed, match="no luck"):
            await queue.result_async(failed_id, timeout=10)
        with pytest.raises(tq.ResultTimeout):
            await queue.result_async(waiting_id, timeout=0.05)
        with pytest.raises(tq.TaskNotFound):
            await queue.result_async(987654321, timeout=10)
        # The loop stays free while a wait goes on: this ticker keeps running.
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        waiting = asyncio.ensure_future(
            queue.result_async(waiting_id, timeout=NEVER, poll_interval=poll_interval(queue))
        )
        await asyncio.to_thread(parked, queue)
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert ticks >= 3
        task = await asyncio.to_thread(claim_one, queue)
        await asyncio.to_thread(queue.complete, task, "late")
        value = await asyncio.wait_for(waiting, 15)
        ticker.cancel()
        return value

    assert asyncio.run(main()) == "late"


@pytest.fixture
def worker_process(backend: Backend) -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []

    def start(strategy: str) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.app", "run-one", "--url", backend.url, "--strategy", strategy],
            cwd=ROOT,
            env=cli_env(backend.url),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)


@pytest.mark.slow
def test_a_result_written_by_a_worker_process(
    queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, worker_process: Callable[[str], Any]
) -> None:
    task_id = enqueue_one(queue, engine, "record", {"key": 42})
    waiter = Waiter(lambda: queue.result(task_id, timeout=120, poll_interval=poll_interval(queue)))
    parked(queue)
    process = worker_process(strategy_name)
    assert waiter.result(120) == 42
    assert process.wait(60) == 0
