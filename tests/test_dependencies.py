"""Dependencies: a task enqueued with ``depends_on`` runs only once its parents have finished.

Every test runs the real claim and the real fenced writes against the
backend's database: a waiting task is asserted unclaimable by claiming,
released by the parent's own completion, cancelled or run by its policy.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.batch_table import batch_table_of
from sa_taskqueue.core.dependency_table import dependency_table_of
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.features.cancellation import write_cancelled
from sa_taskqueue.features.workflows import bookkeeping
from sa_taskqueue.features.workflows.dependencies import decide
from sa_taskqueue.strategies.held_arrays import complete_from_arrays_statement
from sa_taskqueue.strategies.lease import HELD_NOW, complete_many_statement, fail_many_statement, held_params
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import MovableClock, run_cli, task_row, wait_until

ROOT = Path(__file__).resolve().parent.parent

TABLE = tq.Task.__table__
EDGES = dependency_table_of(TABLE)


@pytest.fixture
def flow(engine: sa.Engine, strategy_name: str) -> Iterator[tq.TaskQueue]:
    queue = make_queue(engine, strategy_name, timedelta(minutes=5))

    @queue.task(name="step")
    def step(n: int) -> int:
        return n * 10

    @queue.task(name="takes_depends_on")
    def takes_depends_on(depends_on: str) -> str:
        return depends_on

    yield queue
    queue.close()


def status(engine: sa.Engine, task_id: int) -> tq.TaskStatus:
    return task_row(engine, task_id).status


def claim_all(queue: tq.TaskQueue) -> dict[int, tq.ClaimedTask]:
    return {task.id: task for task in queue.claim(limit=100)}


def test_a_dependent_waits_unclaimable_until_its_parent_completes_and_is_released_by_that_completion(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    step = flow.registered("step")
    assert step is not None
    with Session(engine) as session, session.begin():
        parent = step.enqueue(session, n=1)
        child = step.enqueue(session, n=2, depends_on=[parent])
        parent_id, child_id = parent.id, child.id
    assert status(engine, child_id) is tq.TaskStatus.WAITING
    assert task_row(engine, child_id).parents_pending == 1
    assert task_row(engine, parent_id).has_dependents is True
    claimed = claim_all(flow)
    assert set(claimed) == {parent_id}, "the waiting child is not claimable"
    assert claimed[parent_id].has_dependents is True
    assert claim_all(flow) == {}
    assert flow.complete(claimed[parent_id], 10)
    assert status(engine, child_id) is tq.TaskStatus.QUEUED
    [again] = flow.claim(limit=10)
    assert again.id == child_id
    assert flow.complete(again, 20)


def test_two_parents_release_the_child_only_when_both_have_completed(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        a = flow.enqueue(session, "step", {"n": 1})
        b = flow.enqueue(session, "step", {"n": 2})
        child = flow.enqueue(session, "step", {"n": 3}, depends_on=[a.id, b])
        a_id, b_id, child_id = a.id, b.id, child.id
    claimed = claim_all(flow)
    assert set(claimed) == {a_id, b_id}
    assert flow.complete(claimed[a_id], 1)
    assert (status(engine, child_id), task_row(engine, child_id).parents_pending) == (
        tq.TaskStatus.WAITING,
        1,
    )
    assert claim_all(flow) == {}
    assert flow.complete_many([claimed[b_id]], [2]) == {b_id}
    assert status(engine, child_id) is tq.TaskStatus.QUEUED


def test_both_parents_completed_in_one_batch_release_the_child_once(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        a = flow.enqueue(session, "step", {"n": 1})
        b = flow.enqueue(session, "step", {"n": 2})
        child = flow.enqueue(session, "step", {"n": 3}, depends_on=[a, b])
        a_id, b_id, child_id = a.id, b.id, child.id
    claimed = claim_all(flow)
    assert flow.complete_many([claimed[a_id], claimed[b_id]], [1, 2]) == {a_id, b_id}
    row = task_row(engine, child_id)
    assert (row.status, row.parents_pending) == (tq.TaskStatus.QUEUED, 0)


def test_a_failed_parent_cancels_its_dependents_and_theirs_naming_the_parent(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 1}, max_attempts=1)
        child = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent])
        grandchild = flow.enqueue(session, "step", {"n": 3}, depends_on=[child])
        runs_anyway = flow.enqueue(session, "step", {"n": 4}, depends_on=[child], on_parent_failure="run")
        ids = parent.id, child.id, grandchild.id, runs_anyway.id
    parent_id, child_id, grandchild_id, runs_id = ids
    [claimed] = flow.claim()
    assert flow.fail(claimed, "kaput")
    assert status(engine, parent_id) is tq.TaskStatus.FAILED
    child_row = task_row(engine, child_id)
    assert child_row.status is tq.TaskStatus.CANCELLED
    assert f"parent task {parent_id} failed" in (child_row.last_error or "")
    grandchild_row = task_row(engine, grandchild_id)
    assert grandchild_row.status is tq.TaskStatus.CANCELLED
    assert f"parent task {child_id} was cancelled" in (grandchild_row.last_error or "")
    assert status(engine, runs_id) is tq.TaskStatus.QUEUED, "policy run: released by the cancelled parent"


def test_policy_run_runs_the_dependent_after_a_failed_parent(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    step = flow.registered("step")
    assert step is not None
    with Session(engine) as session, session.begin():
        parent = step.enqueue(session, n=1)
        child = step.using(depends_on=[parent], on_parent_failure="run").enqueue(session, n=2)
        parent_id, child_id = parent.id, child.id
    [claimed] = flow.claim()
    assert claimed.id == parent_id
    assert flow.fail(claimed, "kaput", retry=False)
    assert status(engine, child_id) is tq.TaskStatus.QUEUED


def test_a_dependent_of_finished_parents_is_decided_at_once(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        done = flow.enqueue(session, "step", {"n": 1})
        failed = flow.enqueue(session, "step", {"n": 2}, max_attempts=1)
        done_id, failed_id = done.id, failed.id
    claimed = claim_all(flow)
    assert flow.complete(claimed[done_id], 1)
    assert flow.fail(claimed[failed_id], "kaput")
    with Session(engine) as session, session.begin():
        queued = flow.enqueue(session, "step", {"n": 3}, depends_on=[done_id])
        cancelled = flow.enqueue(session, "step", {"n": 4}, depends_on=[done_id, failed_id])
        ran = flow.enqueue(session, "step", {"n": 5}, depends_on=[failed_id], on_parent_failure="run")
        ids = queued.id, cancelled.id, ran.id
    assert [status(engine, task_id) for task_id in ids] == [
        tq.TaskStatus.QUEUED,
        tq.TaskStatus.CANCELLED,
        tq.TaskStatus.QUEUED,
    ]
    assert f"parent task {failed_id} failed" in (task_row(engine, ids[1]).last_error or "")
    assert task_row(engine, done_id).has_dependents is None, "a finished parent needs no flag"


def test_a_missing_parent_is_refused_and_nothing_is_written(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        parent_id = flow.enqueue(session, "step", {"n": 1}).id
    with Session(engine) as session:
        with pytest.raises(tq.ParentNotFound, match=f"depends_on names task {parent_id + 1000}"):
            flow.enqueue(session, "step", {"n": 2}, depends_on=[parent_id, parent_id + 1000])
        session.rollback()
    with Session(engine) as session:  # refused, then committed anyway
        with pytest.raises(tq.ParentNotFound):
            flow.enqueue(session, "step", {"n": 3}, depends_on=[parent_id, parent_id + 1000])
        session.commit()
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(TABLE)) == 1
        assert conn.scalar(sa.select(sa.func.count()).select_from(EDGES)) == 0
    assert task_row(engine, parent_id).has_dependents is None, "not even the parent's flag stays"


@pytest.mark.parametrize(
    ("depends_on", "error"),
    [
        (5, "got a single int"),
        ("5", "must be a list of tasks or task ids"),
        ([0], "positive integers"),
        ([True], "positive integers"),
        ([1.5], "positive integers"),
    ],
)
def test_bad_depends_on_is_refused_before_anything_is_written(
    flow: tq.TaskQueue, engine: sa.Engine, depends_on: object, error: str
) -> None:
    with Session(engine) as session, pytest.raises(TypeError, match=error):
        flow.enqueue(session, "step", {"n": 1}, depends_on=depends_on)  # type: ignore[arg-type]


def test_a_unique_key_with_depends_on_is_refused(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session:
        parent = flow.enqueue(session, "step", {"n": 1})
        with pytest.raises(ValueError, match="unique key cannot have depends_on"):
            flow.enqueue(session, "step", {"n": 2}, unique_key="k", depends_on=[parent])
        with pytest.raises(ValueError, match="on_parent_failure must be"):
            flow.enqueue(session, "step", {"n": 2}, depends_on=[parent], on_parent_failure="skip")


def test_a_function_with_a_depends_on_param_gets_it_and_using_gives_the_option(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    task = flow.registered("takes_depends_on")
    assert task is not None
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 1})
        as_param = task.enqueue(session, depends_on="a param")
        as_option = task.using(depends_on=[parent]).enqueue(session, depends_on="still a param")
        step = flow.registered("step")
        assert step is not None
        with_options = step.using(priority=3).enqueue(session, n=5, depends_on=[parent])
        ids = as_param.id, as_option.id, with_options.id
    assert status(engine, ids[2]) is tq.TaskStatus.WAITING
    assert task_row(engine, ids[0]).params == {"depends_on": "a param"}
    assert status(engine, ids[0]) is tq.TaskStatus.QUEUED
    assert task_row(engine, ids[1]).params == {"depends_on": "still a param"}
    assert status(engine, ids[1]) is tq.TaskStatus.WAITING


def test_session_add_with_depends_on_waits_for_parents_added_in_the_same_flush(engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        parent = tq.Task(name="step", params={"n": 1})
        child = tq.Task(name="step", params={"n": 2}, depends_on=[parent], on_parent_failure="run")
        session.add_all([parent, child])
        session.flush()
        parent_id, child_id = parent.id, child.id
    child_row = task_row(engine, child_id)
    assert (child_row.status, child_row.parents_pending, child_row.on_parent_failure) == (
        tq.TaskStatus.WAITING,
        1,
        "run",
    )
    assert task_row(engine, parent_id).has_dependents is True
    with engine.connect() as conn:
        assert conn.execute(sa.select(EDGES.c.parent_id, EDGES.c.child_id)).all() == [(parent_id, child_id)]


def test_enqueue_many_with_depends_on_links_every_row(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 0})
        ids = flow.enqueue_many(session, "step", [{"n": n} for n in range(1, 6)], depends_on=[parent])
        parent_id = parent.id
    assert ids is not None and len(ids) == 5
    assert {status(engine, task_id) for task_id in ids} == {tq.TaskStatus.WAITING}
    [claimed] = flow.claim(limit=10)
    assert claimed.id == parent_id
    assert flow.complete(claimed, 0)
    assert {task.id for task in flow.claim(limit=10)} == set(ids)


def test_cancelling_a_waiting_task_cascades_to_its_dependents(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 1})
        child = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent])
        grandchild = flow.enqueue(session, "step", {"n": 3}, depends_on=[child])
        ids = parent.id, child.id, grandchild.id
    result = flow.cancel_task(ids[1])
    assert result.cancelled
    assert result.status is tq.TaskStatus.WAITING
    assert result.message == f"cancelled task {ids[1]}: it was waiting for its parents and will never run"
    assert status(engine, ids[1]) is tq.TaskStatus.CANCELLED
    assert status(engine, ids[2]) is tq.TaskStatus.CANCELLED
    assert status(engine, ids[0]) is tq.TaskStatus.QUEUED


@pytest.mark.parametrize(
    "finish", ["complete", "complete_many", "complete_many_and_claim", "complete_in", "fail", "fail_many"]
)
def test_a_dependent_added_while_its_parent_runs_is_released_by_the_plain_completion(
    flow: tq.TaskQueue, engine: sa.Engine, finish: str
) -> None:
    with Session(engine) as session, session.begin():
        parent_id = flow.enqueue(session, "step", {"n": 1}).id
        other_id = flow.enqueue(session, "step", {"n": 9}).id
    claimed = claim_all(flow)
    assert all(task.has_dependents is None for task in claimed.values()), "claimed as plain tasks"
    with Session(engine) as session, session.begin():
        child_id = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent_id]).id
    assert status(engine, child_id) is tq.TaskStatus.WAITING
    parent, other = claimed[parent_id], claimed[other_id]
    # The worker ends the parent as the plain task it claimed: that write itself settles the child.
    if finish == "complete":
        assert flow.complete(parent, 1)
    elif finish == "complete_many":
        assert flow.complete_many([other, parent], [9, 1]) == {parent_id, other_id}
    elif finish == "complete_many_and_claim":
        written, _ = flow.complete_many_and_claim([other, parent], [9, 1], limit=1)
        assert written == {parent_id, other_id}
    elif finish == "complete_in":
        with engine.connect() as conn:
            conn.begin()
            assert flow.complete_in(conn, parent, 1)
            conn.commit()
    elif finish == "fail":
        assert flow.fail(parent, "kaput", retry=False)
    else:
        assert flow.fail_many([other, parent], ["no", "kaput"], retry=False) == {parent_id, other_id}
    ended = tq.TaskStatus.FAILED if finish.startswith("fail") else tq.TaskStatus.COMPLETED
    assert status(engine, parent_id) is ended
    expected = tq.TaskStatus.CANCELLED if ended is tq.TaskStatus.FAILED else tq.TaskStatus.QUEUED
    assert status(engine, child_id) in (expected, tq.TaskStatus.RUNNING)  # (the claim may take it at once)


def test_a_chain_runs_step_by_step_each_reading_the_result_before_it(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    @flow.task(name="add")
    def add(n: int) -> int:
        previous = tq.current_task().parent_results()
        return n + (tq.current_task().parent_result() if previous else 0)

    with Session(engine) as session, session.begin():
        rows = flow.chain(session, add.call(n=1), add.call(n=10), add.using(priority=5).call(n=100))
        ids = [row.id for row in rows]
    assert [status(engine, task_id) for task_id in ids] == [
        tq.TaskStatus.QUEUED,
        tq.TaskStatus.WAITING,
        tq.TaskStatus.WAITING,
    ]
    flow.run_worker(concurrency=2, burst=True, poll_interval=0.05)
    assert [task_row(engine, task_id).result for task_id in ids] == [1, 11, 111]
    assert flow.parent_results(ids[2]) == {ids[1]: 11}


def test_a_chain_step_that_fails_cancels_the_rest(flow: tq.TaskQueue, engine: sa.Engine) -> None:
    step = flow.registered("step")
    boom = flow.registered("boom")
    assert step is not None and boom is not None
    with Session(engine) as session, session.begin():
        rows = flow.chain(
            session, step.call(n=1), boom.using(max_attempts=1).call(message="no"), step.call(n=3)
        )
        ids = [row.id for row in rows]
    flow.run_worker(concurrency=1, burst=True, poll_interval=0.05)
    assert [status(engine, task_id) for task_id in ids] == [
        tq.TaskStatus.COMPLETED,
        tq.TaskStatus.FAILED,
        tq.TaskStatus.CANCELLED,
    ]
    with Session(engine) as session, pytest.raises(TypeError, match="chain step 2 must be"):
        flow.chain(session, step.call(n=1), step)  # type: ignore[arg-type]
    with Session(engine) as session, pytest.raises(ValueError, match="at least one step"):
        flow.chain(session)


def test_a_transactional_completion_releases_in_its_transaction_and_not_when_it_rolls_back(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 1})
        child = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent])
        parent_id, child_id = parent.id, child.id
    [claimed] = flow.claim()
    with engine.connect() as conn:
        conn.begin()
        assert flow.complete_in(conn, claimed, 10)
        conn.rollback()
    assert status(engine, parent_id) is tq.TaskStatus.RUNNING
    assert status(engine, child_id) is tq.TaskStatus.WAITING, "rolled back with the completion"
    with engine.connect() as conn:
        conn.begin()
        assert flow.complete_in(conn, claimed, 10)
        conn.commit()
    assert status(engine, parent_id) is tq.TaskStatus.COMPLETED
    assert status(engine, child_id) is tq.TaskStatus.QUEUED


def test_lease_recovery_that_fails_a_parent_cancels_its_dependents(
    engine: sa.Engine, strategy_name: str, clock: MovableClock
) -> None:
    if strategy_name == "advisory_lock":
        pytest.skip("advisory locks, not leases, say when a worker is gone (tested with processes)")
    queue = make_queue(engine, strategy_name, timedelta(seconds=30), clock.now)
    try:
        with Session(engine) as session, session.begin():
            parent = queue.enqueue(session, "record", {"key": 1}, max_attempts=1)
            child = queue.enqueue(session, "record", {"key": 2}, depends_on=[parent])
            parent_id, child_id = parent.id, child.id
        [claimed] = queue.claim()
        assert claimed.id == parent_id
        clock.advance(timedelta(minutes=1))
        assert queue.recover() == 1
    finally:
        queue.close()
    assert status(engine, parent_id) is tq.TaskStatus.FAILED
    child_row = task_row(engine, child_id)
    assert child_row.status is tq.TaskStatus.CANCELLED
    assert f"parent task {parent_id} failed" in (child_row.last_error or "")


def test_a_late_plain_completion_after_recovery_releases_nothing_twice(
    engine: sa.Engine, strategy_name: str, clock: MovableClock
) -> None:
    if strategy_name == "advisory_lock":
        pytest.skip("advisory locks, not leases, say when a worker is gone")
    queue = make_queue(engine, strategy_name, timedelta(seconds=30), clock.now)
    try:
        with Session(engine) as session, session.begin():
            parent_id = queue.enqueue(session, "record", {"key": 1}).id
        [first] = queue.claim()
        with Session(engine) as session, session.begin():
            child_id = queue.enqueue(session, "record", {"key": 2}, depends_on=[parent_id]).id
        clock.advance(timedelta(minutes=1))
        assert queue.recover() == 1  # queued again: a retry is not final
        assert status(engine, child_id) is tq.TaskStatus.WAITING
        [second] = queue.claim()
        assert second.has_dependents is True
        assert not queue.complete(first, "late"), "the lost claim writes nothing"
        assert status(engine, child_id) is tq.TaskStatus.WAITING
        assert queue.complete(second, "on time")
    finally:
        queue.close()
    assert task_row(engine, child_id).parents_pending == 0
    assert status(engine, child_id) is tq.TaskStatus.QUEUED


@pytest.mark.async_path
def test_the_async_enqueue_and_chain_take_depends_on(
    request: pytest.FixtureRequest, backend: Backend, engine: sa.Engine
) -> None:
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
    from sqlalchemy.pool import NullPool

    from tests.backends import ASYNC_DRIVERS, async_url

    async_engine = create_async_engine(
        async_url(backend.url, ASYNC_DRIVERS[backend.name][0]), poolclass=NullPool
    )
    queue = tq.TaskQueue(async_engine, lease=timedelta(minutes=5))

    @queue.task(name="step")
    def step(n: int) -> int:
        return n

    async def enqueue() -> tuple[int, int, list[int]]:
        async with AsyncSession(async_engine) as session, session.begin():
            parent = await step.enqueue(session, n=1)
            child = await step.enqueue(session, n=2, depends_on=[parent])
            chained = await queue.chain(session, step.call(n=3), step.call(n=4))
            return parent.id, child.id, [row.id for row in chained]

    try:
        parent_id, child_id, chained = asyncio.run(enqueue())
    finally:
        queue.close()
    assert status(engine, parent_id) is tq.TaskStatus.QUEUED
    assert status(engine, child_id) is tq.TaskStatus.WAITING
    assert [status(engine, task_id) for task_id in chained] == [tq.TaskStatus.QUEUED, tq.TaskStatus.WAITING]


def test_two_parents_completed_at_once_from_two_processes_release_the_child_exactly_once(
    backend: Backend, engine: sa.Engine
) -> None:
    """Each parent's completion runs in its own process; whichever commits second releases the child."""
    for _ in range(5):
        queue = make_queue(engine, None, timedelta(minutes=5))
        try:
            with Session(engine) as session, session.begin():
                a = queue.enqueue(session, "record", {"key": 1})
                b = queue.enqueue(session, "record", {"key": 2})
                child = queue.enqueue(session, "record", {"key": 3}, depends_on=[a, b])
                child_id = child.id
            claimed = queue.claim(limit=2)
            assert len(claimed) == 2
        finally:
            queue.close()
        script = (
            "import sys, pickle, base64; from datetime import timedelta;"
            "from tests.app import make_engine, make_queue;"
            "task = pickle.loads(base64.b64decode(sys.argv[2]));"
            "q = make_queue(make_engine(sys.argv[1]), None, timedelta(minutes=5));"
            "sys.stdin.readline();"
            "print(q.complete(task, 1))"
        )
        processes = [
            subprocess.Popen(
                [sys.executable, "-c", script, backend.url, base64.b64encode(pickle.dumps(task)).decode()],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for task in claimed
        ]
        for process in processes:  # both ready: let them complete at once
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        outputs = [process.communicate(timeout=60)[0].strip() for process in processes]
        assert outputs == ["True", "True"]
        row = task_row(engine, child_id)
        assert (row.status, row.parents_pending) == (tq.TaskStatus.QUEUED, 0)
        with engine.begin() as conn:
            for table in reversed(tq.metadata.sorted_tables):
                conn.execute(table.delete())


class Recorder:
    """A connection that compiles what it is given for one dialect, runs nothing, and returns no rows."""

    def __init__(self, dialect: sa.engine.Dialect) -> None:
        self.dialect = dialect
        self.seen: list[str] = []

    def execute(self, statement: sa.Executable, *args: object) -> Recorder:
        compiled = statement.compile(dialect=self.dialect)  # type: ignore[attr-defined]
        self.seen.append(" ".join(str(compiled).split()))
        return self

    def all(self) -> list[object]:
        return []


DIALECTS = [postgresql.dialect(), mysql.dialect(), oracle.dialect(), sqlite.dialect()]
DIALECT_IDS = ["postgresql", "mysql", "oracle", "sqlite"]


@pytest.mark.parametrize("dialect", DIALECTS, ids=DIALECT_IDS)
def test_the_release_and_the_cascade_compile_on_every_dialect(dialect: sa.engine.Dialect) -> None:
    conn = Recorder(dialect)
    bookkeeping.release(conn, TABLE, [1, 2])  # type: ignore[arg-type]
    bookkeeping.after_final(
        conn,  # type: ignore[arg-type]
        TABLE,
        [bookkeeping.FinishedTask(7, tq.TaskStatus.FAILED, None, True)],
        utcnow(),
    )
    release = conn.seen[0]
    assert release.startswith("UPDATE sa_taskqueue_task SET status=CASE WHEN"), release
    # Assigned first: MySQL's left-to-right assignments then read the old parents_pending.
    assert release.index("status=") < release.index("parents_pending="), release
    assert "FROM sa_taskqueue_task_dependencies" in release
    cascade = conn.seen[1]
    assert cascade.startswith("SELECT sa_taskqueue_task.id, sa_taskqueue_task.on_parent_failure"), cascade
    if dialect.name != "sqlite":  # (SQLite takes its one write lock instead)
        assert cascade.endswith("FOR UPDATE"), cascade


@pytest.mark.parametrize("dialect", DIALECTS, ids=DIALECT_IDS)
def test_a_dependents_enqueue_flags_then_locks_its_parents_on_every_dialect(
    dialect: sa.engine.Dialect,
) -> None:
    conn = Recorder(dialect)
    with pytest.raises(tq.ParentNotFound):  # (the recorder finds no parent)
        decide(conn, TABLE, [3, 1], 0, None, utcnow())  # type: ignore[arg-type]
    flag, lock = conn.seen
    assert flag.startswith("UPDATE sa_taskqueue_task SET has_dependents="), flag
    assert "has_dependents IS NULL" in flag
    assert "ORDER BY sa_taskqueue_task.id" in lock
    if dialect.name != "sqlite":
        assert lock.endswith("FOR UPDATE"), lock


@pytest.mark.parametrize("dialect", DIALECTS, ids=DIALECT_IDS)
def test_plain_final_writes_carry_the_dependents_fence_and_renewals_do_not(
    dialect: sa.engine.Dialect,
) -> None:
    def compiled(statement: object) -> str:
        return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]

    fence = "sa_taskqueue_task.has_dependents IS NULL"
    assert fence in compiled(complete_many_statement(TABLE, 2, True, returning=False))
    assert fence not in compiled(complete_many_statement(TABLE, 2, True, returning=False, fenced=False))
    assert "has_dependents" not in compiled(fail_many_statement(TABLE, 2, clears_slots=False)), (
        "the fence is added by the plain path alone"
    )
    if dialect.name == "postgresql":
        assert fence in compiled(complete_from_arrays_statement(TABLE, HELD_NOW))
    renewal = sa.update(TABLE).where(SkipLockedStrategy().holds(TABLE)).values(locked_until=utcnow())
    assert "has_dependents" not in compiled(renewal)


def test_the_cli_counts_waiting_tasks_and_cancels_one_with_its_dependents(
    backend: Backend, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        parent = tq.Task(name="a", queue="mail")
        child = tq.Task(name="b", queue="mail", depends_on=[parent])
        grandchild = tq.Task(name="c", queue="mail", depends_on=[child])
        session.add_all([parent, child, grandchild])
        session.flush()
        ids = parent.id, child.id, grandchild.id
    status_output = run_cli("status", url=backend.url)
    assert status_output.returncode == 0, status_output.stderr
    header = next(line for line in status_output.stdout.splitlines() if "queue" in line and "waiting" in line)
    row = next(line for line in status_output.stdout.splitlines() if "mail" in line)
    columns = [cell.strip() for cell in header.split("┃" if "┃" in header else "|") if cell.strip()]
    cells = [cell.strip() for cell in row.split("│" if "│" in row else "|") if cell.strip()]
    assert dict(zip(columns, cells, strict=True))["waiting"] == "2"
    cancelled = run_cli("cancel", str(ids[1]), url=backend.url)
    assert cancelled.returncode == 0, cancelled.stderr
    assert [status(engine, task_id) for task_id in ids] == [
        tq.TaskStatus.QUEUED,
        tq.TaskStatus.CANCELLED,
        tq.TaskStatus.CANCELLED,
    ]


@pytest.mark.requires("advisory_locks")
def test_advisory_recovery_that_fails_a_parent_cancels_its_dependents(engine: sa.Engine) -> None:
    holder = make_queue(engine, "advisory_lock", timedelta(minutes=5))
    rescuer = make_queue(engine, "advisory_lock", timedelta(minutes=5))
    try:
        with Session(engine) as session, session.begin():
            parent = holder.enqueue(session, "record", {"key": 1}, max_attempts=1)
            child = holder.enqueue(session, "record", {"key": 2}, depends_on=[parent])
            parent_id, child_id = parent.id, child.id
        [claimed] = holder.claim()
        assert claimed.id == parent_id
        holder.strategy.close()  # its connection, and the lock on the task, are gone: as a dead worker's
        assert rescuer.recover() == 1
    finally:
        holder.close()
        rescuer.close()
    assert status(engine, parent_id) is tq.TaskStatus.FAILED
    assert status(engine, child_id) is tq.TaskStatus.CANCELLED


def test_a_waiting_task_is_never_claimed_by_a_running_worker_until_its_parent_completes(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    """A real claim loop polls all along; the child runs only after its parent's completion is written."""
    release_parent = threading.Event()
    order: list[str] = []

    @flow.task(name="held")
    def held() -> str:
        order.append("parent started")
        assert release_parent.wait(30)
        order.append("parent ends")
        return "parent done"

    @flow.task(name="after")
    def after() -> str:
        parent_row = task_row(engine, next(iter(tq.current_task().parent_results())))
        order.append(f"child started, parent {parent_row.status.value}")
        return "child done"

    with Session(engine) as session, session.begin():
        parent = held.enqueue(session)
        child = after.enqueue(session, depends_on=[parent])
        parent_id, child_id = parent.id, child.id
    worker = tq.Worker(flow, concurrency=2, poll_interval=0.02)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_until(lambda: order == ["parent started"], 30, "the parent to start")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:  # a second of polling with a free slot: the child stays waiting
            assert status(engine, child_id) is tq.TaskStatus.WAITING
            time.sleep(0.05)
        release_parent.set()
        wait_until(lambda: status(engine, child_id) is tq.TaskStatus.COMPLETED, 30, "the child to run")
    finally:
        release_parent.set()
        worker.stop()
        thread.join(30)
    assert order == ["parent started", "parent ends", "child started, parent completed"]
    assert task_row(engine, parent_id).result == "parent done"


def test_batch_members_are_counted_once_in_the_transaction_of_their_final_write(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    batches = batch_table_of(TABLE)
    with engine.begin() as conn:
        conn.execute(batches.insert().values(name="b", created_at=utcnow()))
        batch_id = conn.execute(sa.select(batches.c.id)).scalar_one()
    with Session(engine) as session, session.begin():
        ok = tq.Task(name="step", params={"n": 1}, batch_id=batch_id)
        bad = tq.Task(name="step", params={"n": 2}, batch_id=batch_id, max_attempts=1)
        session.add_all([ok, bad])
        session.flush()
        waiting = tq.Task(name="step", params={"n": 3}, batch_id=batch_id, depends_on=[bad])
        session.add(waiting)
        session.flush()
        ok_id, bad_id = ok.id, bad.id
    claimed = claim_all(flow)
    assert {task.batch_id for task in claimed.values()} == {batch_id}
    assert flow.complete_many([claimed[ok_id]], [1]) == {ok_id}
    assert not flow.complete(claimed[ok_id], 1), "written once: a second write finds it finished"
    assert flow.fail(claimed[bad_id], "kaput")
    with engine.connect() as conn:
        counts = conn.execute(
            sa.select(batches.c.total, batches.c.succeeded, batches.c.failed, batches.c.cancelled)
        ).one()
    # (total is the batch API's to count; the outcomes are counted here, the waiting member cancelled.)
    assert tuple(counts)[1:] == (1, 1, 1)


@pytest.mark.parametrize("flag_at_claim", [True, False], ids=["dependent-first", "dependent-while-running"])
def test_a_running_parent_stopped_by_a_cancel_cancels_its_dependents(
    flow: tq.TaskQueue, engine: sa.Engine, flag_at_claim: bool
) -> None:
    with Session(engine) as session, session.begin():
        parent = flow.enqueue(session, "step", {"n": 1})
        parent_id = parent.id
        if flag_at_claim:
            child_id = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent]).id
    [claimed] = flow.claim()
    assert bool(claimed.has_dependents) is flag_at_claim
    if not flag_at_claim:
        with Session(engine) as session, session.begin():
            child_id = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent_id]).id
    # The worker's write once it has stopped the task (`sa_taskqueue.worker.cancelling`).
    assert write_cancelled(flow.strategy, flow.engine, TABLE, claimed, utcnow())
    assert status(engine, parent_id) is tq.TaskStatus.CANCELLED
    child_row = task_row(engine, child_id)
    assert child_row.status is tq.TaskStatus.CANCELLED
    assert f"parent task {parent_id} was cancelled" in (child_row.last_error or "")


def test_without_the_fence_a_dependent_added_while_its_parent_runs_would_wait_for_ever(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    """The check of the race tests above can fail: the same completion, unfenced, strands the child."""
    with Session(engine) as session, session.begin():
        parent_id = flow.enqueue(session, "step", {"n": 1}).id
    [claimed] = flow.claim()
    with Session(engine) as session, session.begin():
        child_id = flow.enqueue(session, "step", {"n": 2}, depends_on=[parent_id]).id
    unfenced = complete_many_statement(TABLE, 1, False, returning=False, fenced=False)
    params = {HELD_NOW: utcnow(), "finished_now": utcnow(), **held_params(claimed, suffix="_0")}
    with engine.begin() as conn:
        assert conn.execute(unfenced, params).rowcount == 1
    assert status(engine, parent_id) is tq.TaskStatus.COMPLETED
    assert status(engine, child_id) is tq.TaskStatus.WAITING
    assert claim_all(flow) == {}, "nothing left to release it"


@pytest.mark.requires("advisory_locks")
@pytest.mark.parametrize("finish", ["complete_many", "fail_many"])
def test_advisory_workflow_writes_hold_by_the_lock_past_the_lease(
    engine: sa.Engine, clock: MovableClock, finish: str
) -> None:
    """Under advisory locks the lock, not the lease, says who holds a task: a long run still writes."""
    queue = make_queue(engine, "advisory_lock", timedelta(seconds=30), clock.now)
    try:
        with Session(engine) as session, session.begin():
            parent = queue.enqueue(session, "record", {"key": 1}, max_attempts=1)
            other = queue.enqueue(session, "record", {"key": 9}, max_attempts=1)
            child = queue.enqueue(session, "record", {"key": 2}, depends_on=[parent])
            parent_id, other_id, child_id = parent.id, other.id, child.id
        claimed = {task.id: task for task in queue.claim(limit=5)}
        assert set(claimed) == {parent_id, other_id}
        clock.advance(timedelta(minutes=5))  # far past the lease: no renewal ran
        tasks = [claimed[other_id], claimed[parent_id]]
        if finish == "complete_many":
            assert queue.complete_many(tasks, [9, 1]) == {parent_id, other_id}
        else:
            assert queue.fail_many(tasks, ["no", "kaput"]) == {parent_id, other_id}
    finally:
        queue.close()
    expected = tq.TaskStatus.QUEUED if finish == "complete_many" else tq.TaskStatus.CANCELLED
    assert status(engine, child_id) is expected


# Retries of tasks in a graph ------------------------------------------------------------------


def test_a_retried_parent_is_counted_once_by_a_dependent_that_runs_whatever_its_parents(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        a = flow.enqueue(session, "step", {"n": 1}, max_attempts=1)
        b = flow.enqueue(session, "step", {"n": 2})
        child = flow.enqueue(session, "step", {"n": 3}, depends_on=[a, b], on_parent_failure="run")
        a_id, b_id, child_id = a.id, b.id, child.id
    claimed = claim_all(flow)
    assert flow.fail(claimed[a_id], "boom", retry=False)
    assert task_row(engine, child_id).parents_pending == 1, "a's failure counted"
    assert Admin(engine, flow.table).retry(a_id) == 1
    assert task_row(engine, child_id).parents_pending == 2, "a is unfinished again: it counts once more"
    [again] = flow.claim(limit=10)
    assert again.id == a_id
    assert flow.complete(again, 1)
    assert status(engine, b_id) is tq.TaskStatus.RUNNING
    assert status(engine, child_id) is tq.TaskStatus.WAITING, "b has not finished"
    assert flow.complete(claimed[b_id], 2)
    assert status(engine, child_id) is tq.TaskStatus.QUEUED


def test_a_retried_dependent_waits_again_for_its_unfinished_parents(
    flow: tq.TaskQueue, engine: sa.Engine
) -> None:
    with Session(engine) as session, session.begin():
        a = flow.enqueue(session, "step", {"n": 1})
        child = flow.enqueue(session, "step", {"n": 3}, depends_on=[a])
        a_id, child_id = a.id, child.id
    assert flow.cancel_task(child_id).cancelled
    assert Admin(engine, flow.table).retry(child_id) == 1
    row = task_row(engine, child_id)
    assert (row.status, row.parents_pending) == (tq.TaskStatus.WAITING, 1), "a is still queued"
    claimed = claim_all(flow)
    assert set(claimed) == {a_id}, "only the parent is claimable"
    assert flow.complete(claimed[a_id], 10)
    assert status(engine, child_id) is tq.TaskStatus.QUEUED, "released by its parent's completion"


def test_a_retry_of_every_failed_task_counts_each_parent_once_more_in_chunks(
    flow: tq.TaskQueue, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sa_taskqueue.features.workflows import dependencies

    monkeypatch.setattr(dependencies, "REOPENED_CHUNK", 2)
    with Session(engine) as session, session.begin():
        parents = [flow.enqueue(session, "step", {"n": n}, max_attempts=1) for n in range(5)]
        child = flow.enqueue(session, "step", {"n": 9}, depends_on=parents, on_parent_failure="run")
        child_id = child.id
    for task in claim_all(flow).values():
        assert flow.fail(task, "boom", retry=False)
    assert status(engine, child_id) is tq.TaskStatus.QUEUED, "released by its last parent's end"
    with engine.begin() as conn:  # (as if its last parent had not ended yet)
        conn.execute(
            sa.update(TABLE)
            .where(TABLE.c.id == child_id)
            .values(status=tq.TaskStatus.WAITING, parents_pending=0)
        )
    assert Admin(engine, flow.table).retry(None) == 5
    assert task_row(engine, child_id).parents_pending == 5, "each retried parent counted once more"
