"""Successes finishing together share one write, and a slot's thread never waits for a write it need not.

`Completions` holds no SQL: these tests give it writers that record what
they were handed, so what is tested is when batches go and who is told.
The worker's own tests (tests/test_worker.py) cover the same against every
database.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import pytest

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.worker.completions import Completions
from tests.helpers import wait_until

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def claimed(task_id: int) -> ClaimedTask:
    return ClaimedTask(
        id=task_id,
        name="noop",
        queue="default",
        priority=0,
        params={},
        attempts=1,
        max_attempts=3,
        run_at=NOW,
        created_at=NOW,
        started_at=NOW,
        locked_by="worker",
        locked_until=NOW,
    )


class Writes:
    """The batches written, each as its ids and the thread that wrote it."""

    def __init__(self) -> None:
        self.batches: list[tuple[list[int], str]] = []
        self.errors: list[BaseException | str] = []
        self.writing = threading.Event()
        self.may_write = threading.Event()
        self.may_write.set()

    def many(self, tasks: Sequence[ClaimedTask], _results: Sequence[Any]) -> set[int]:
        self.writing.set()
        self.may_write.wait(30)
        self.batches.append(([task.id for task in tasks], threading.current_thread().name))
        return {task.id for task in tasks}

    def one(self, task: ClaimedTask, _result: Any) -> None:
        self.batches.append(([task.id], threading.current_thread().name))

    def failures(self, tasks: Sequence[ClaimedTask], errors: Sequence[BaseException | str]) -> set[int]:
        """Failures go in batches of their own, told apart by negative ids, with their errors kept."""
        self.errors.extend(errors)
        self.batches.append(([-task.id for task in tasks], threading.current_thread().name))
        return {task.id for task in tasks}

    def failure(self, task: ClaimedTask, error: BaseException | str) -> None:
        self.errors.append(error)
        self.batches.append(([-task.id], threading.current_thread().name))


@contextmanager
def serving(
    writes: Writes, delay: float, write_many: Any = None, fail_many: Any = None
) -> Iterator[Completions]:
    """Completions writing through ``writes`` (or those given), their thread started, closed after."""
    completions = Completions(
        write_many or writes.many,
        writes.one,
        delay=delay,
        fail_many=fail_many or writes.failures,
        fail_one=writes.failure,
    )
    completions.start()
    try:
        yield completions
    finally:
        writes.may_write.set()
        completions.close(timeout=30)


def told(into: dict[int, bool | None], task_id: int) -> Any:
    return lambda recorded: into.__setitem__(task_id, recorded)


def test_the_last_success_of_a_claimed_batch_writes_it_in_one_statement_on_its_own_thread() -> None:
    writes = Writes()
    with serving(writes, 600) as completions:
        for _ in range(3):
            completions.begin()
        recorded: dict[int, bool | None] = {}
        completions.hand_off(claimed(1), None, told(recorded, 1))
        completions.hand_off(claimed(2), None, told(recorded, 2))
        assert writes.batches == [] and recorded == {}, "two of three ended: the batch waits for the third"
        completions.hand_off(claimed(3), None, told(recorded, 3))
        assert writes.batches == [([1, 2, 3], threading.current_thread().name)]
        assert recorded == {1: True, 2: True, 3: True}


def test_a_success_waits_for_a_task_still_running_no_longer_than_the_delay() -> None:
    writes = Writes()
    with serving(writes, 0.05) as completions:
        completions.begin()
        completions.begin()  # never ends during the test
        recorded: dict[int, bool | None] = {}
        completions.hand_off(claimed(1), None, told(recorded, 1))
        wait_until(lambda: recorded, 30, "the writing thread to write the lone success after the delay")
        assert recorded == {1: True}
        assert writes.batches == [([1], "sa_taskqueue-completions")]


def test_successes_ending_during_a_write_go_together_in_the_next() -> None:
    writes = Writes()
    with serving(writes, 600) as completions:
        completions.begin()
        completions.begin()
        writes.may_write.clear()
        first = threading.Thread(target=completions.record, args=(claimed(1), None))
        first.start()
        completions.end_without_success()  # the other task failed: task 1's batch is due
        assert writes.writing.wait(30), "the first write is under way"
        recorded: dict[int, bool | None] = {}
        completions.begin()
        completions.begin()
        completions.hand_off(claimed(3), None, told(recorded, 3))
        completions.hand_off(claimed(4), None, told(recorded, 4))
        assert recorded == {}, "written only once the write on its way is"
        writes.may_write.set()
        first.join(30)
        wait_until(lambda: len(recorded) == 2, 30, "the second batch")
        assert [ids for ids, _ in writes.batches] == [[1], [3, 4]]


def test_closing_writes_what_waits_and_a_success_after_closing_is_written_at_once() -> None:
    writes = Writes()
    completions = Completions(writes.many, writes.one, delay=600)
    completions.start()
    completions.begin()
    completions.begin()  # still running when the worker stops
    recorded: dict[int, bool | None] = {}
    completions.hand_off(claimed(1), None, told(recorded, 1))
    assert recorded == {}
    completions.close(timeout=30)
    assert recorded == {1: True}
    # A task given back, ending after its worker returned, still has its success written.
    assert completions.record(claimed(2), None) is True
    assert [ids for ids, _ in writes.batches] == [[1], [2]]


def test_a_batch_whose_write_fails_is_written_one_by_one_and_each_is_told() -> None:
    def fails(_tasks: Sequence[ClaimedTask], _results: Sequence[Any]) -> set[int]:
        raise RuntimeError("injected: the batch write fails")

    writes = Writes()
    with serving(writes, 600, fails) as completions:
        completions.begin()
        completions.begin()
        recorded: dict[int, bool | None] = {}
        completions.hand_off(claimed(1), None, told(recorded, 1))
        completions.hand_off(claimed(2), None, told(recorded, 2))
        assert [ids for ids, _ in writes.batches] == [[1], [2]]
        assert recorded == {1: None, 2: None}  # each write reports for itself


def test_closing_while_a_slot_writes_its_batch_returns_once_that_write_is_done() -> None:
    writes = Writes()
    completions = Completions(writes.many, writes.one, delay=600)
    completions.start()
    completions.begin()
    writes.may_write.clear()
    slot = threading.Thread(target=completions.record, args=(claimed(1), None))
    slot.start()  # the batch is due at once: written on the slot's own thread
    assert writes.writing.wait(30), "the slot's write is under way"
    closer = threading.Thread(target=completions.close, kwargs={"timeout": 60})
    closer.start()
    # Released only once the close is asked for, so the write ends after it.
    wait_until(lambda: completions._closing, 10, "the close to be asked for")
    assert closer.is_alive(), "close() waits for the write on its way"
    writes.may_write.set()
    wait_until(lambda: not closer.is_alive(), 10, "close() to return once the slot's write is done")
    slot.join(30)
    assert [ids for ids, _ in writes.batches] == [[1]]


def test_failures_wait_as_successes_do_and_go_in_a_statement_of_their_own() -> None:
    writes = Writes()
    with serving(writes, 600) as completions:
        completions.begin(4)
        recorded: dict[int, bool | None] = {}
        completions.hand_off(claimed(1), None, told(recorded, 1), error="first")
        completions.hand_off(claimed(2), "two", told(recorded, 2))
        completions.hand_off(claimed(3), None, told(recorded, 3), error=ValueError("third"))
        assert writes.batches == [] and recorded == {}, "three of four ended: the batch waits for the fourth"
        completions.hand_off(claimed(4), None, told(recorded, 4), error="fourth")
        thread = threading.current_thread().name
        assert writes.batches == [([2], thread), ([-1, -3, -4], thread)]
        assert [str(error) for error in writes.errors] == ["first", "third", "fourth"]
        assert recorded == dict.fromkeys((1, 2, 3, 4), True)


def test_a_failure_batch_whose_write_fails_is_written_one_by_one_and_each_is_told() -> None:
    def fails(_tasks: Sequence[ClaimedTask], _errors: Sequence[Any]) -> set[int]:
        raise RuntimeError("injected: the batch write fails")

    writes = Writes()
    with serving(writes, 600, fail_many=fails) as completions:
        completions.begin(2)
        recorded: dict[int, bool | None] = {}
        completions.hand_off(claimed(1), None, told(recorded, 1), error="one")
        completions.hand_off(claimed(2), None, told(recorded, 2), error="two")
        assert [ids for ids, _ in writes.batches] == [[-1], [-2]]
        assert writes.errors == ["one", "two"]
        assert recorded == {1: None, 2: None}  # each write reports for itself


def test_completions_given_no_failure_writers_refuse_a_failure() -> None:
    writes = Writes()
    completions = Completions(writes.many, writes.one, delay=600)
    with pytest.raises(ValueError, match="write no failures"):
        completions.hand_off(claimed(1), None, told({}, 1), error="boom")
    with pytest.raises(ValueError, match="given together"):
        Completions(writes.many, writes.one, fail_many=writes.failures)
