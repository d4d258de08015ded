"""Claiming: order, due time, leases, and the outcomes only the holder may write."""

from __future__ import annotations

import dataclasses
import json
import pickle
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import MovableClock, task_row, wait_until
from tests.helpers import enqueue_records as enqueue

#: The smallest step a stored time takes.
TICK = timedelta(microseconds=1)


def let_the_claim_go(queue: tq.TaskQueue, clock: MovableClock, strategy_name: str, lease: timedelta) -> None:
    """Move ``clock`` far enough for ``queue``'s next claim to give back a task whose holder is gone.

    That claim's recovery pass does it, and recovery runs at most once per
    recovery interval on the same clock.  The lease strategies must also see
    the lease run out; an advisory task is held by its lock, not its lease, so
    there the interval alone.
    """
    interval = queue.strategy.recovery_interval(lease)
    clock.advance(interval if strategy_name == "advisory_lock" else lease + interval)


def advisory_lock_is_free(engine: sa.Engine, table: sa.Table, task_id: int) -> bool:
    """Whether another connection may take ``task_id``'s advisory lock now (it gives it back at once)."""
    from sa_taskqueue.strategies.advisory import AdvisoryLocks

    locks = AdvisoryLocks(engine, table)
    with engine.connect() as conn:
        taken = locks.try_lock(conn, [task_id])
        locks.unlock(conn, taken)
    return taken == [task_id]


def drop_the_lock_holder(holder: tq.TaskQueue, engine: sa.Engine, task_id: int) -> None:
    """Close ``holder``'s advisory-lock connections and wait for the server to let ``task_id``'s lock go.

    The server drops a closed connection's locks once its backend has seen
    the close, a moment later: a recovery pass must not run before that.
    """
    holder.close()  # the strategy's connections, through the queue (on an async engine, its loop)
    wait_until(lambda: advisory_lock_is_free(engine, holder.table, task_id), 30, "the lock to go")


def test_claim_marks_the_task_running_under_a_lease(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    [task_id] = enqueue(queue, engine, 1)
    claimed_at = clock.advance(timedelta(seconds=3))
    [claimed] = queue.claim(worker_id="worker-a")
    assert isinstance(claimed, tq.ClaimedTask)
    assert (claimed.id, claimed.name, claimed.params, claimed.attempts) == (task_id, "record", {"key": 0}, 1)
    assert claimed.locked_by == "worker-a"
    assert (claimed.started_at, claimed.locked_until) == (claimed_at, claimed_at + queue.lease)
    row = task_row(engine, task_id)
    assert row.status == tq.TaskStatus.RUNNING
    assert row.attempts == 1
    assert row.locked_by == "worker-a"
    assert row.started_at == claimed_at
    assert row.locked_until == claimed.locked_until
    assert queue.claim() == [], "a running task is not claimed again while its lease holds"


def test_claim_takes_at_most_limit_in_priority_then_run_at_then_id_order(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    now = clock.now() - timedelta(minutes=1)
    with Session(engine) as session:
        specs = [(5, 0), (1, 3), (1, 1), (-2, 9), (1, 1)]  # (priority, seconds after now)
        ids = [
            queue.enqueue(session, "record", {"key": n}, priority=p, run_at=now + timedelta(seconds=s)).id
            for n, (p, s) in enumerate(specs)
        ]
        session.commit()
    expected = [ids[3], ids[2], ids[4], ids[1]]
    assert [task.id for task in queue.claim(limit=4)] == expected
    assert [task.id for task in queue.claim(limit=4)] == [ids[0]]
    assert queue.claim(limit=4) == []


def test_a_task_is_not_claimed_before_run_at(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    soon = clock.now() + timedelta(seconds=1.5)
    with Session(engine) as session:
        queue.enqueue(session, "record", {"key": 1}, run_at=soon)
        session.commit()
    assert queue.claim() == []
    clock.advance(soon - TICK - clock.now())
    assert queue.claim() == [], "not a microsecond early"
    clock.advance(TICK)
    assert len(queue.claim()) == 1, "due at run_at"


def test_recovery_runs_at_once_when_the_clock_steps_back(engine: sa.Engine, lease: timedelta) -> None:
    # A wall clock stepped back (NTP) must not hold recovery off for as long as it stepped.
    now = [datetime(2030, 1, 1, tzinfo=UTC)]
    queue = make_queue(engine, None, lease, lambda: now[0])
    runs: list[datetime] = []
    recover = queue.recover
    queue.recover = lambda: runs.append(now[0]) or recover()  # type: ignore[method-assign]
    queue.claim()
    queue.claim()
    assert len(runs) == 1, "at most once per recovery interval"
    now[0] -= timedelta(hours=1)
    queue.claim()
    assert runs == [datetime(2030, 1, 1, tzinfo=UTC), datetime(2029, 12, 31, 23, tzinfo=UTC)]
    queue.close()


def test_a_clock_must_tell_an_aware_time(engine: sa.Engine) -> None:
    with pytest.raises(TypeError, match="aware datetime"):
        tq.TaskQueue(engine, clock=lambda: datetime(2030, 1, 1))


def test_claim_only_from_the_queues_asked_for(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    [mail] = enqueue(queue, engine, 1, queue="mail")
    [report] = enqueue(queue, engine, 1, queue="reports")
    assert queue.claim(queues=["other"]) == []
    assert [t.id for t in queue.claim(queues=["reports", "other"])] == [report]
    assert [t.id for t in queue.claim(limit=5, queues=("mail",))] == [mail]


def test_a_cancelled_task_is_never_claimed(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    first, second = enqueue(queue, engine, 2)
    assert queue.cancel(first) is True
    assert queue.cancel(first) is False, "only a queued task can be cancelled"
    [claimed] = queue.claim(limit=5)
    assert claimed.id == second
    # A running task is not cancelled under its worker: the request is recorded, for the worker to act on.
    assert queue.cancel(second) is True
    assert task_row(engine, second).status == tq.TaskStatus.RUNNING
    assert task_row(engine, second).cancel_requested_at is not None
    assert task_row(engine, first).status == tq.TaskStatus.CANCELLED
    assert task_row(engine, first).finished_at is not None


def test_complete_records_the_result(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    enqueue(queue, engine, 1)
    [claimed] = queue.claim()
    assert queue.complete(claimed, {"sent": True, "n": [1, 2]}) is True
    row = task_row(engine, claimed.id)
    assert row.status == tq.TaskStatus.COMPLETED
    assert row.result == {"sent": True, "n": [1, 2]}
    assert row.finished_at is not None and row.finished_at.utcoffset() == timedelta(0)
    assert queue.complete(claimed) is False, "an outcome is written once"
    with pytest.raises(TypeError, match="result"):
        queue.complete(claimed, object())


def test_failures_retry_with_growing_backoff_then_fail_with_the_traceback(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    with Session(engine) as session:
        task_id = queue.enqueue(session, "boom", {"message": "kaput"}, max_attempts=3).id
        session.commit()
    delays = []
    for attempt in (1, 2, 3):
        [claimed] = queue.claim()
        assert (claimed.id, claimed.attempts) == (task_id, attempt)
        try:
            queue.registered("boom").func(**claimed.params)  # type: ignore[union-attr]
        except ValueError as error:
            failed_at = clock.now()
            assert queue.fail(claimed, error) is True
        row = task_row(engine, task_id)
        assert row.last_error is not None
        assert "Traceback" in row.last_error and "ValueError: kaput" in row.last_error
        if attempt < 3:
            assert row.status == tq.TaskStatus.QUEUED
            delays.append(row.run_at - failed_at)
            clock.advance(row.run_at - TICK - clock.now())
            assert queue.claim() == [], "not retried before its run_at"
            clock.advance(TICK)
    assert row.status == tq.TaskStatus.FAILED
    assert row.finished_at == failed_at
    base = timedelta(milliseconds=50)  # the boom task's retry_delay
    assert base <= delays[0] <= base * 1.25  # up to 25% jitter
    assert base * 2 <= delays[1] <= base * 2 * 1.25
    clock.advance(timedelta(days=1))
    assert queue.claim() == []


def test_a_string_error_is_kept_as_given(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    enqueue(queue, engine, 1, max_attempts=1)
    [claimed] = queue.claim()
    assert queue.fail(claimed, "upstream said no") is True
    row = task_row(engine, claimed.id)
    assert (row.status, row.last_error) == (tq.TaskStatus.FAILED, "upstream said no")


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_a_worker_that_lost_its_task_cannot_overwrite_the_new_holders_outcome(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    queue = clocked_queue
    [task_id] = enqueue(queue, engine, 1)
    [first] = queue.claim(worker_id="first")
    if strategy_name == "advisory_lock":
        # Advisory locks outlive any lease: the task is lost when the holder's
        # lock goes, as when its connection drops.
        drop_the_lock_holder(queue, engine, task_id)
    let_the_claim_go(queue, clock, strategy_name, lease)
    [second] = queue.claim(worker_id="second")
    assert (second.id, second.attempts) == (task_id, 2)
    assert queue.complete(first, "stale") is False
    assert queue.fail(first, RuntimeError("stale")) is False
    assert queue.extend_leases([first]) == set()
    rival = make_queue(engine, strategy_name, lease, clock.now)
    assert rival.claim(worker_id="third") == [], "the stale calls left the new holder's claim intact"
    rival.close()
    assert queue.complete(second, "fresh") is True
    row = task_row(engine, task_id)
    assert (row.status, row.result, row.locked_by) == (tq.TaskStatus.COMPLETED, "fresh", "second")


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_extending_the_lease_keeps_the_task(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, lease: timedelta, clock: MovableClock
) -> None:
    queue = clocked_queue
    [task_id] = enqueue(queue, engine, 1)
    [claimed] = queue.claim()
    for _ in range(3):  # 1.5 s in all: longer than the lease
        clock.advance(lease / 2)
        assert queue.extend_leases([claimed]) == {claimed.id}
    assert task_row(engine, task_id).locked_until > claimed.locked_until + timedelta(seconds=1)
    assert queue.claim() == [], "still held: its lease was renewed"
    assert queue.complete(claimed) is True


def test_a_task_built_from_a_claimed_row_is_the_snapshot_its_constructor_builds() -> None:
    now = datetime.now(UTC)
    row = {
        "id": 7,
        "name": "record",
        "queue": "default",
        "priority": 0,
        "params": '{"key": 1}',
        "attempts": 1,
        "max_attempts": 3,
        "run_at": now,
        "created_at": now,
        "started_at": now,
        "locked_by": "w",
        "locked_until": now,
    }
    built = tq.ClaimedTask.from_row(row)
    expected = tq.ClaimedTask(**{**row, "params": {"key": 1}})  # type: ignore[arg-type]
    assert built == expected and repr(built) == repr(expected)
    assert dataclasses.replace(built, attempts=2) == dataclasses.replace(expected, attempts=2)
    assert pickle.loads(pickle.dumps(built)) == expected
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.attempts = 2  # type: ignore[misc]

    @dataclasses.dataclass(frozen=True)
    class Checked(tq.ClaimedTask):
        def __post_init__(self) -> None:
            if self.attempts > self.max_attempts:
                raise ValueError("over its attempts")

    with pytest.raises(ValueError, match="over its attempts"):
        Checked.from_row({**row, "attempts": 4})


def test_release_gives_a_task_back_without_counting_the_attempt(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    enqueue(queue, engine, 1)
    [claimed] = queue.claim(worker_id="w")
    assert queue.release(claimed) is True
    [again] = queue.claim(worker_id="w")
    assert (again.id, again.attempts, again.locked_by) == (claimed.id, 1, "w")
    assert queue.complete(claimed, "stale") is False, "the given-back claim is not the new one"
    assert queue.complete(again, "fresh") is True


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_complete_many_writes_only_the_tasks_still_held_each_with_its_result(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    queue = clocked_queue
    lost_id, kept_id, other_id = enqueue(queue, engine, 3)
    loser = make_queue(engine, strategy_name, lease, clock.now)
    [lost] = loser.claim(worker_id="first")
    if strategy_name == "advisory_lock":
        drop_the_lock_holder(loser, engine, lost_id)  # the lock, not the lease, says who holds the task
    let_the_claim_go(queue, clock, strategy_name, lease)
    [second] = queue.claim(worker_id="second")
    assert second.id == lost_id
    kept, other = queue.claim(limit=2, worker_id="first")
    loser.close()
    written = queue.complete_many([lost, kept, other], [{"n": 1}, None, [1, "two"]])
    assert written == {kept_id, other_id}
    rows = {task_id: task_row(engine, task_id) for task_id in (lost_id, kept_id, other_id)}
    assert (rows[lost_id].status, rows[lost_id].locked_by) == (tq.TaskStatus.RUNNING, "second")
    assert (rows[kept_id].status, rows[kept_id].result) == (tq.TaskStatus.COMPLETED, None)
    assert (rows[other_id].status, rows[other_id].result) == (tq.TaskStatus.COMPLETED, [1, "two"])
    assert rows[kept_id].finished_at is not None and rows[kept_id].locked_until is None
    # Time moves on between the two writes, as it does for any real clock.
    # (Without RETURNING the queue tells the rows it wrote by their finish
    # time, so a second write in the same microsecond would count the first's.)
    clock.advance(TICK)
    assert queue.complete_many([kept]) == set(), "a finished task is not written twice"


def test_complete_many_refuses_a_claim_given_back_and_taken_again_by_the_same_worker(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    # The claim given back and the one that took the task again share the
    # worker and the attempt (a release does not count it): only the start
    # tells them apart, and the batch must not let the old claim write.
    queue = clocked_queue
    given_back_id, other_id = enqueue(queue, engine, 2)
    given_back, other = queue.claim(limit=2, worker_id="w")
    assert queue.release(given_back) is True
    clock.advance(TICK)
    [again] = queue.claim(worker_id="w")
    assert (again.id, again.attempts, again.locked_by) == (given_back_id, given_back.attempts, "w")
    assert queue.complete_many([given_back, other], ["stale", "other's"]) == {other_id}
    row = task_row(engine, given_back_id)
    assert (row.status, row.result) == (tq.TaskStatus.RUNNING, None)
    clock.advance(TICK)
    assert queue.complete_many([again, given_back], ["fresh", "stale"]) == {given_back_id}
    assert task_row(engine, given_back_id).result == "fresh"


def a_claim_lost_and_a_claim_kept(
    queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> tuple[tq.ClaimedTask, tq.ClaimedTask, tq.ClaimedTask]:
    """Two tasks claimed by worker "first": the claim of one lost to worker "second", the other's kept.

    Returns the lost claim, the new holder's claim of the same task, and the kept claim.
    """
    lost_id, kept_id = enqueue(queue, engine, 2)
    loser = make_queue(engine, strategy_name, lease, clock.now)
    [lost] = loser.claim(worker_id="first")
    if strategy_name == "advisory_lock":
        drop_the_lock_holder(loser, engine, lost_id)  # the lock, not the lease, says who holds the task
    let_the_claim_go(queue, clock, strategy_name, lease)
    [second] = queue.claim(worker_id="second")
    [kept] = queue.claim(worker_id="first")
    loser.close()
    assert (second.id, kept.id) == (lost_id, kept_id)
    return lost, second, kept


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_complete_many_of_one_task_writes_it_with_its_result_only_while_held(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    # A worker's lone success goes alone (on PostgreSQL not as arrays of one):
    # the same claim test, the same result, the same ids back.
    queue = clocked_queue
    lost, _new_holder, kept = a_claim_lost_and_a_claim_kept(queue, engine, strategy_name, lease, clock)
    lost_id, kept_id = lost.id, kept.id
    assert queue.complete_many([lost], [{"n": 1}]) == set()
    assert queue.complete_many([kept], [{"n": 2}]) == {kept_id}
    lost_row, kept_row = task_row(engine, lost_id), task_row(engine, kept_id)
    assert (lost_row.status, lost_row.locked_by, lost_row.result) == (tq.TaskStatus.RUNNING, "second", None)
    assert (kept_row.status, kept_row.result) == (tq.TaskStatus.COMPLETED, {"n": 2})
    assert kept_row.locked_until is None


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_complete_many_never_counts_the_new_holders_completion_as_its_own(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    # Without RETURNING the queue asks which rows it wrote; the new holder's
    # completion, in the same microsecond, must not pass for the old one's.
    queue = clocked_queue
    lost, second, kept = a_claim_lost_and_a_claim_kept(queue, engine, strategy_name, lease, clock)
    lost_id, kept_id = lost.id, kept.id
    assert queue.complete(second, "the new holder's")
    assert queue.complete_many([lost, kept]) == {kept_id}
    assert task_row(engine, lost_id).result == "the new holder's"


def test_complete_many_checks_every_result_before_writing_any(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    enqueue(queue, engine, 2)
    first, second = queue.claim(limit=2)
    with pytest.raises(TypeError, match=f"task {second.id}"):
        queue.complete_many([first, second], [1, {"bad": object()}])
    with pytest.raises(ValueError, match="2 tasks"):
        queue.complete_many([first, second], [1])
    assert {task_row(engine, task.id).status for task in (first, second)} == {tq.TaskStatus.RUNNING}
    assert queue.complete_many([first, second]) == {first.id, second.id}


def test_complete_many_stores_each_result_as_complete_stores_it(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    results: list[Any] = [
        'quotes " and \\ backslashes, a tab\t and a newline\n',
        "ünïcödé, 漢字 and an emoji 🎉",
        {"nested": {"list": [1, 2.5, True, None], "empty": {}}, "": []},
        [],
        2**53 + 1,
        -0.125,
        False,
        "",
        None,
        {"n": 1, "comma,": "brace}", 'quote"': "x"},
    ]
    ids = enqueue(queue, engine, 2 * len(results))
    claimed = queue.claim(limit=len(ids))
    by_one, together = claimed[: len(results)], claimed[len(results) :]
    for task, result in zip(by_one, results, strict=True):
        assert queue.complete(task, result)
    assert queue.complete_many(together, results) == {task.id for task in together}
    for one, other, result in zip(by_one, together, results, strict=True):
        assert task_row(engine, one.id).result == task_row(engine, other.id).result == result


@pytest.mark.backends("postgres")
def test_complete_many_takes_an_engines_json_serializer_that_gives_bytes(
    backend: Backend, engine: sa.Engine, strategy_name: str, lease: timedelta
) -> None:
    # orjson's dumps, say, gives UTF-8 bytes: psycopg takes them for one
    # result, and a batch of results takes them too.
    bytes_engine = sa.create_engine(backend.url, json_serializer=lambda value: json.dumps(value).encode())
    queue = make_queue(bytes_engine, strategy_name, lease)
    try:
        enqueue(queue, engine, 3)
        alone, *together = queue.claim(limit=3)
        assert queue.complete(alone, {"alone": "é"})
        assert queue.complete_many(together, [{"n": 1}, ["ü", None]]) == {task.id for task in together}
        results = [task_row(engine, task.id).result for task in (alone, *together)]
        assert results == [{"alone": "é"}, {"n": 1}, ["ü", None]]
    finally:
        queue.close()
        bytes_engine.dispose()


def test_complete_many_writes_more_tasks_than_one_statement_takes(
    queue: tq.TaskQueue, engine: sa.Engine
) -> None:
    ids = enqueue(queue, engine, 250)
    claimed = queue.claim(limit=250)
    assert queue.complete_many(claimed, [task.id for task in claimed]) == set(ids)
    assert {(row.status, row.result) for row in (task_row(engine, i) for i in ids[:3])} == {
        (tq.TaskStatus.COMPLETED, i) for i in ids[:3]
    }


def test_fail_many_writes_each_failure_as_fail_writes_it_retried_or_failed_for_good(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    retried = enqueue(queue, engine, 2, max_attempts=3)
    final = enqueue(queue, engine, 2, max_attempts=1)
    claimed = {task.id: task for task in queue.claim(limit=4)}
    by_one = [claimed[retried[0]], claimed[final[0]]]
    together = [claimed[retried[1]], claimed[final[1]]]
    errors: list[BaseException | str] = [ValueError("kaput"), "upstream said no"]
    failed_at = clock.now()
    for task, error in zip(by_one, errors, strict=True):
        assert queue.fail(task, error) is True
    assert queue.fail_many(together, errors) == {task.id for task in together}
    for one, other in zip(by_one, together, strict=True):
        one_row, other_row = task_row(engine, one.id), task_row(engine, other.id)
        assert (other_row.status, other_row.last_error, other_row.finished_at, other_row.locked_until) == (
            one_row.status,
            one_row.last_error,
            one_row.finished_at,
            None,
        )
    retried_row, final_row = task_row(engine, retried[1]), task_row(engine, final[1])
    assert retried_row.status == tq.TaskStatus.QUEUED and retried_row.finished_at is None
    assert retried_row.last_error is not None and "ValueError: kaput" in retried_row.last_error
    registered = queue.registered("record")
    assert registered is not None
    base = registered.options.retry_delay
    assert base <= retried_row.run_at - failed_at <= base * 1.25  # up to 25% jitter
    assert (final_row.status, final_row.last_error, final_row.finished_at) == (
        tq.TaskStatus.FAILED,
        "upstream said no",
        failed_at,
    )
    assert final_row.run_at == task_row(engine, final[0]).run_at, "a failure for good keeps its run_at"
    # Time moves on between the two writes, as it does for any real clock.
    # (Without RETURNING the queue tells the rows it wrote by the times it
    # wrote, so a second write in the same microsecond would count the first's.)
    clock.advance(TICK)
    assert queue.fail_many(together, errors) == set(), "a failure is written once"


def test_fail_many_without_retry_ends_every_task_failed_at_once(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, clock: MovableClock
) -> None:
    queue = clocked_queue
    ids = enqueue(queue, engine, 3, max_attempts=5)
    claimed = queue.claim(limit=3)
    assert queue.fail_many(claimed, ["no"] * 3, retry=False) == set(ids)
    assert {(task_row(engine, i).status, task_row(engine, i).finished_at) for i in ids} == {
        (tq.TaskStatus.FAILED, clock.now())
    }


@pytest.mark.parametrize("lease", [timedelta(seconds=1)])
def test_fail_many_writes_only_the_tasks_still_held(
    clocked_queue: tq.TaskQueue, engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> None:
    queue = clocked_queue
    lost, second, kept = a_claim_lost_and_a_claim_kept(queue, engine, strategy_name, lease, clock)
    assert queue.fail_many([lost, kept], ["the old holder's", "kept's"]) == {kept.id}
    lost_row, kept_row = task_row(engine, lost.id), task_row(engine, kept.id)
    assert (lost_row.status, lost_row.locked_by) == (tq.TaskStatus.RUNNING, "second")
    assert lost_row.last_error != "the old holder's"
    assert (kept_row.status, kept_row.last_error) == (tq.TaskStatus.QUEUED, "kept's")
    # Nor does it take the new holder's failure, written first, for its own.
    clock.advance(TICK)
    assert queue.fail(second, "the new holder's") is True
    assert queue.fail_many([lost], ["the old holder's"]) == set()
    assert task_row(engine, lost.id).last_error == "the new holder's"


def test_fail_many_refuses_bad_input_before_writing_anything(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    enqueue(queue, engine, 2)
    first, second = queue.claim(limit=2)
    with pytest.raises(ValueError, match="errors has 1 entries for 2 tasks"):
        queue.fail_many([first, second], ["only one"])
    with pytest.raises(TypeError, match="not a single string"):
        queue.fail_many([first], "boom")
    with pytest.raises(TypeError, match=f"task {second.id} must be an exception or a string, got int"):
        queue.fail_many([first, second], ["fine", 42])  # type: ignore[list-item]
    assert {task_row(engine, task.id).status for task in (first, second)} == {tq.TaskStatus.RUNNING}
    assert queue.fail_many([], []) == set()
    assert queue.fail_many([first, second], ["a", "b"]) == {first.id, second.id}


def test_fail_many_writes_more_tasks_than_one_statement_takes(queue: tq.TaskQueue, engine: sa.Engine) -> None:
    ids = enqueue(queue, engine, 120, max_attempts=1)
    claimed = queue.claim(limit=120)
    assert queue.fail_many(claimed, [f"error {task.id}" for task in claimed]) == set(ids)
    assert {(row.status, row.last_error) for row in (task_row(engine, i) for i in ids[::40])} == {
        (tq.TaskStatus.FAILED, f"error {i}") for i in ids[::40]
    }
