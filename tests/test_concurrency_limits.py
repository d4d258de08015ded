"""Per-key concurrency limits: never more than N running per key, across workers, processes and claims."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.model import CONCURRENCY_KEY_LENGTH
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.limited import candidates_query, take_statement
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy
from tests.backends import Backend
from tests.helpers import MovableClock, wait_until
from tests.limited_app import LIMIT, make_limited_queue, peaks, reset, runs

ROOT = Path(__file__).resolve().parent.parent
TABLE = tq.Task.__table__
NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture
def limited_queue(engine: sa.Engine, strategy_name: str) -> Iterator[tq.TaskQueue]:
    queue = make_limited_queue(engine, strategy_name, timedelta(minutes=5))
    yield queue
    queue.close()


def enqueue(queue: tq.TaskQueue, engine: sa.Engine, keys: list[str], name: str = "limited") -> list[int]:
    with Session(engine) as session:
        ids = [queue.enqueue(session, name, {"key": key, "n": n}).id for n, key in enumerate(keys)]
        session.commit()
    return ids


def running_per_key(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tq.Task.concurrency_key, tq.Task.concurrency_slot).where(
                tq.Task.status == tq.TaskStatus.RUNNING
            )
        ).all()
    slots = {(key, slot) for key, slot in rows}
    assert len(slots) == len(rows), f"two running tasks share a slot: {rows}"
    return Counter(key for key, _ in rows)


# The race --------------------------------------------------------------------------


def race_process(
    backend: Backend, strategy_name: str, tmp_path: Path, n: int, limit: int
) -> tuple[Path, subprocess.Popen[str]]:
    ready = tmp_path / f"ready-{n}"
    args = ["--url", backend.url, "--strategy", strategy_name, "--limit", str(limit)]
    args += ["--ready", str(ready), "--go", str(tmp_path / "go")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.limited_app", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return ready, proc


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_racing_worker_processes_never_run_more_than_the_limit_per_key(
    backend: Backend, engine: sa.Engine, strategy_name: str, tmp_path: Path
) -> None:
    # 4 processes of 4 threads (16 slots of work) against 6 keys of limit 2
    # (12 allowed at once), each key's tasks enqueued together: without the
    # limit, one key's tasks would run many at once.
    limit = int(os.environ.get("SA_TASKQUEUE_TEST_RACE_LIMIT", LIMIT))  # 0 shows the race fails unlimited
    keys = [f"k{n}" for n in range(6)]
    reset(engine, keys)
    queue = make_limited_queue(engine, strategy_name, timedelta(minutes=5))
    with Session(engine) as session:
        queue.enqueue_many(
            session, "limited", ({"key": keys[n // 20], "n": n, "sleep": 0.05} for n in range(120))
        )
        session.commit()
    queue.close()
    procs = [race_process(backend, strategy_name, tmp_path, n, limit) for n in range(4)]
    try:
        wait_until(lambda: all(ready.exists() for ready, _ in procs), 120, "the workers to start")
        (tmp_path / "go").touch()
        outputs = [proc.communicate(timeout=240) for _, proc in procs]
    finally:
        for _, proc in procs:
            proc.kill()
    for (_, proc), (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err
        # Slot conflicts are settled inside the claim, never left to the worker as errors.
        assert "deadlock" not in err.lower() and "database is locked" not in err.lower(), err
        assert "claim" not in err.lower(), err
    assert runs(engine) == list(range(120)), "every task ran, once"
    found = peaks(engine)
    assert max(found.values()) <= LIMIT, f"more than {LIMIT} of a key ran at once: {found}"
    assert max(found.values()) == LIMIT, f"the workers really raced: {found}"


# The claim -----------------------------------------------------------------------------


def test_a_claim_takes_at_most_the_limit_per_key_and_keys_are_independent(
    engine: sa.Engine, limited_queue: tq.TaskQueue
) -> None:
    enqueue(limited_queue, engine, ["a"] * 5 + ["b"] * 5 + ["c"])
    claimed = limited_queue.claim(limit=20)
    assert Counter(task.params["key"] for task in claimed) == {"a": 2, "b": 2, "c": 1}
    assert {(task.concurrency_key, task.concurrency_slot) for task in claimed} == {
        ('limited:"a"', 0),
        ('limited:"a"', 1),
        ('limited:"b"', 0),
        ('limited:"b"', 1),
        ('limited:"c"', 0),
    }
    assert limited_queue.claim(limit=20) == [], "every key is full"
    assert running_per_key(engine) == {'limited:"a"': 2, 'limited:"b"': 2, 'limited:"c"': 1}


def test_a_worker_looks_for_limited_tasks_again_when_told_or_after_its_recheck_time(
    engine: sa.Engine, limited_queue: tq.TaskQueue
) -> None:
    # A claim that found no limited task lets the next ones leave the limited
    # claim out (here for an hour, so the test does not race the clock) ...
    assert limited_queue.claim(limit=5, limited_recheck=3600) == []
    (waiting,) = enqueue(limited_queue, engine, ["a"])
    assert limited_queue.claim(limit=5, limited_recheck=3600) == []
    # ... until a NOTIFY or a freed slot says to look again.
    limited_queue.recheck_limited()
    assert [task.id for task in limited_queue.claim(limit=5, limited_recheck=3600)] == [waiting]


def test_rows_enqueued_without_a_key_do_not_hold_up_other_keys(
    engine: sa.Engine, limited_queue: tq.TaskQueue
) -> None:
    # Rows added around enqueue (session.add, an admin tool) carry no key; a
    # claim works out the keys of the rows it reads and stores them, so the
    # next claims pass them by once their key is full: a backlog of them
    # holds other keys up for a claim per window of rows, not for ever.
    with Session(engine) as session:
        session.add_all(tq.Task(name="limited", params={"key": "a", "n": n}) for n in range(40))
        session.commit()
    (other,) = enqueue(limited_queue, engine, ["b"])
    claimed: list[int] = []
    for _ in range(8):  # a window is 10 rows at limit=1: 38 rows to pass by
        claimed += [task.id for task in limited_queue.claim(limit=1)]
    assert other in claimed
    assert running_per_key(engine) == {'limited:"a"': 2, 'limited:"b"': 1}


def test_a_paused_queue_holds_its_limited_tasks_too(engine: sa.Engine, limited_queue: tq.TaskQueue) -> None:
    with Session(engine) as session:
        held = limited_queue.enqueue(session, "limited", {"key": "a", "n": 0}, queue="held").id
        session.commit()
    limited_queue.pause("held")
    assert limited_queue.claim(limit=5) == []
    limited_queue.resume("held")
    assert [task.id for task in limited_queue.claim(limit=5)] == [held]


def test_a_slot_is_freed_by_completion_failure_release_and_lease_recovery(
    engine: sa.Engine, strategy_name: str
) -> None:
    clock = MovableClock()
    lease = timedelta(minutes=5)
    queue = make_limited_queue(engine, strategy_name, lease, clock.now)
    try:
        enqueue(queue, engine, ["a"] * 8)
        first, second = queue.claim(limit=5)
        assert queue.claim() == []
        assert queue.complete(first) is True
        [third] = queue.claim(limit=5)
        assert third.concurrency_slot == first.concurrency_slot, "the completed task's slot"
        assert queue.fail(second, "boom") is True  # back to queued, later
        [fourth] = queue.claim(limit=5)
        assert fourth.concurrency_slot == second.concurrency_slot, "the failed task's slot"
        assert queue.release(fourth) is True
        [fifth] = queue.claim(limit=5)
        assert fifth.concurrency_slot == fourth.concurrency_slot, "the released task's slot"
        assert queue.claim() == []
        if strategy_name != "advisory_lock":
            # Both leases run out: the recovery pass frees both slots.
            clock.advance(lease + queue.strategy.recovery_interval(lease) + timedelta(seconds=1))
            assert len(queue.claim(limit=5)) == LIMIT
        assert max(running_per_key(engine).values()) <= LIMIT
    finally:
        queue.close()


def test_a_task_given_back_can_run_on_a_release_without_the_limit(
    engine: sa.Engine, strategy_name: str
) -> None:
    # A release that dropped the limit claims with the plain claim and takes
    # no slot: the slot the row last held must not come back with it.
    clock = MovableClock()
    limited = make_limited_queue(engine, strategy_name, timedelta(minutes=5), clock.now)
    unlimited = make_limited_queue(engine, strategy_name, timedelta(minutes=5), clock.now, limit=None)
    try:
        enqueue(limited, engine, ["a"] * 3)
        first, _second = limited.claim(limit=5)
        assert limited.fail(first, "boom") is True  # to be retried later
        [third] = limited.claim(limit=5)
        assert third.concurrency_slot == first.concurrency_slot
        clock.advance(timedelta(minutes=1))
        [again] = unlimited.claim(names=["limited"])
        assert (again.id, again.attempts, again.concurrency_slot) == (first.id, 2, None)
    finally:
        limited.close()
        unlimited.close()


def test_concurrent_claims_never_exceed_the_limit_with_a_slot_held(
    engine: sa.Engine, strategy_name: str
) -> None:
    # One task of "a" already running holds a slot; eight claimers, each with
    # its own queue (its own strategy and connections), race for the rest.
    holder = make_limited_queue(engine, strategy_name, timedelta(minutes=5))
    enqueue(holder, engine, ["a"])
    [held] = holder.claim()
    enqueue(holder, engine, ["a"] * 10 + ["b"] * 10)
    queues = [make_limited_queue(engine, strategy_name, timedelta(minutes=5)) for _ in range(8)]
    start = threading.Barrier(len(queues))
    claimed: list[tq.ClaimedTask] = []
    errors: list[BaseException] = []

    def claimer(queue: tq.TaskQueue) -> None:
        try:
            start.wait()
            for _ in range(3):
                claimed.extend(queue.claim(limit=3))
        except Exception as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    threads = [threading.Thread(target=claimer, args=(queue,)) for queue in queues]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == []
        per_key = Counter(task.params["key"] for task in claimed)
        assert per_key["a"] <= LIMIT - 1 and per_key["b"] <= LIMIT, per_key
        assert running_per_key(engine) == {'limited:"a"': per_key["a"] + 1, 'limited:"b"': per_key["b"]}
        # Whatever the conflicts cost the racers, one more claim fills what is free.
        holder.claim(limit=10)
        assert running_per_key(engine) == {'limited:"a"': LIMIT, 'limited:"b"': LIMIT}
        assert held.concurrency_slot == 0
    finally:
        for queue in [holder, *queues]:
            queue.close()


def test_limited_and_plain_tasks_share_a_claim(engine: sa.Engine, limited_queue: tq.TaskQueue) -> None:
    enqueue(limited_queue, engine, ["a"] * 3)
    with Session(engine) as session:
        limited_queue.enqueue_many(session, "whole", [{"n": 1}, {"n": 2}])
        limited_queue.enqueue_many(session, "plain", [{"n": 1}, {"n": 2}])
        session.commit()
    claimed = limited_queue.claim(limit=10, names=limited_queue.task_names)
    assert Counter(task.name for task in claimed) == {"limited": 2, "whole": 1, "plain": 2}
    [whole] = [task for task in claimed if task.name == "whole"]
    assert (whole.concurrency_key, whole.concurrency_slot) == ("whole", 0)
    plain = [task for task in claimed if task.name == "plain"]
    assert {task.concurrency_key for task in plain} == {None}


def test_the_plain_claim_runs_the_same_sql_with_limited_tasks_registered(
    engine: sa.Engine, strategy_name: str
) -> None:
    def statements_of_claim(queue: tq.TaskQueue) -> list[str]:
        with Session(engine) as session:
            queue.enqueue(session, "plain", {"n": 1})
            session.commit()
        queue.claim(limit=1, names=["plain"])  # compiles and keeps what it needs
        seen: list[str] = []

        def record(conn: object, cursor: object, statement: str, *args: object) -> None:
            seen.append(statement)

        sa.event.listen(engine, "before_cursor_execute", record)
        try:
            with Session(engine) as session:
                queue.enqueue(session, "plain", {"n": 2})
                session.commit()
            seen.clear()
            assert len(queue.claim(limit=1, names=["plain"])) == 1
        finally:
            sa.event.remove(engine, "before_cursor_execute", record)
        return seen

    # Time stands still and the paused queues, once read, are kept: the first
    # claim's recovery and pause read are not run again by the second claim
    # however slow the machine, so only the claim's own statements are seen.
    clock = MovableClock()
    unlimited = make_limited_queue(engine, strategy_name, timedelta(minutes=5), clock.now, limit=None)
    limited = make_limited_queue(engine, strategy_name, timedelta(minutes=5), clock.now)
    for queue in (unlimited, limited):
        queue.paused.max_age = 3600.0
    try:
        assert statements_of_claim(limited) == statements_of_claim(unlimited)
    finally:
        unlimited.close()
        limited.close()


# Keys, at registration and enqueue ------------------------------------------------


def test_the_key_is_set_on_every_enqueue_path(engine: sa.Engine, limited_queue: tq.TaskQueue) -> None:
    limited = limited_queue.registered("limited")
    assert limited is not None
    with Session(engine) as session:
        limited_queue.enqueue(session, "limited", {"key": "one", "n": 1})
        limited_queue.enqueue_many(session, "limited", [{"key": "many", "n": 2}])
        limited.enqueue(session, key="task", n=3)
        limited.using(priority=5).enqueue(session, key="using", n=4)
        limited.using(priority=5).enqueue_many(session, [{"key": "using_many", "n": 5}])
        limited_queue.enqueue(session, "whole", {"n": 6})
        limited_queue.enqueue(session, "plain", {"n": 7})
        session.commit()
        rows = session.execute(sa.select(tq.Task.name, tq.Task.params, tq.Task.concurrency_key)).all()
    found = {(name, params.get("key")): key for name, params, key in rows}
    assert found == {
        ("limited", "one"): 'limited:"one"',
        ("limited", "many"): 'limited:"many"',
        ("limited", "task"): 'limited:"task"',
        ("limited", "using"): 'limited:"using"',
        ("limited", "using_many"): 'limited:"using_many"',
        ("whole", None): "whole",
        ("plain", None): None,
    }


def test_keys_of_several_params_a_function_and_a_long_value() -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))

    @queue.task(name="pair", concurrency_limit=3, concurrency_key=("a", "b"))
    def pair(a: int, b: str = "x", c: int = 0) -> None: ...

    @queue.task(name="by_function", concurrency_limit=1, concurrency_key=lambda p: p["url"].split("/")[2])
    def by_function(url: str) -> None: ...

    def key_of(name: str, **params: object) -> str:
        registered = queue.registered(name)
        assert registered is not None and registered.options.concurrency is not None
        return registered.options.concurrency.key_of(params)

    assert key_of("pair", a=1, c=5) == 'pair:[1,"x"]', "a param left out takes its default"
    assert key_of("pair", b="y", a=1) == 'pair:[1,"y"]'
    assert key_of("by_function", url="https://example.org/x") == "by_function:example.org"
    long = key_of("by_function", url="https://" + "h" * 300 + "/x")
    assert len(long) <= CONCURRENCY_KEY_LENGTH and long.startswith("by_function:sha256:")
    assert long != key_of("by_function", url="https://" + "h" * 301 + "/x")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"concurrency_limit": 0}, ValueError, "concurrency_limit must be at least 1"),
        ({"concurrency_limit": True}, TypeError, "concurrency_limit must be a positive int"),
        ({"concurrency_limit": "2"}, TypeError, "concurrency_limit must be a positive int"),
        ({"concurrency_limit": 2, "concurrency_key": "nope"}, ValueError, "does not take: \\['nope'\\]"),
        ({"concurrency_limit": 2, "concurrency_key": ()}, TypeError, "concurrency_key must be"),
        ({"concurrency_key": "key"}, ValueError, "concurrency_key needs a concurrency_limit"),
    ],
)
def test_bad_limits_are_refused_at_registration(
    options: dict[str, object], error: type[Exception], message: str
) -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))
    with pytest.raises(error, match=message):

        @queue.task(name="t", **options)  # type: ignore[call-overload]
        def t(key: str) -> None: ...


# SQL where no server runs ---------------------------------------------------------


def compiled(statement: object, dialect: sa.engine.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]


REQUEST = ClaimRequest(
    limit=4, queues=None, worker_id="w", now=NOW, lease_until=NOW + timedelta(minutes=5), names=("limited",)
)


def test_oracle_locks_limited_candidates_from_an_unbounded_cursor() -> None:
    query = SkipLockedStrategy().limited_candidates(
        oracle.dialect(), candidates_query(TABLE, REQUEST, ["full"]), REQUEST
    )
    text = compiled(query, oracle.dialect())
    assert text.endswith("FOR UPDATE SKIP LOCKED"), text
    assert "FETCH FIRST" not in text and "ROWNUM" not in text, "ORA-02014 with FOR UPDATE"
    assert "concurrency_key NOT IN" in text
    take = compiled(take_statement(TABLE, REQUEST), oracle.dialect())
    assert take.startswith("UPDATE sa_taskqueue_task SET") and "RETURNING" not in take
    assert "concurrency_slot=:limited_slot" in take.replace(" ", "")


def test_mysql_locks_limited_candidates_then_updates_without_returning() -> None:
    query = SkipLockedStrategy().limited_candidates(
        mysql.dialect(), candidates_query(TABLE, REQUEST, []), REQUEST
    )
    text = compiled(query, mysql.dialect())
    assert text.endswith("LIMIT %s FOR UPDATE SKIP LOCKED"), text
    assert "NOT IN" not in text, "no key is full"
    take = compiled(take_statement(TABLE, REQUEST), mysql.dialect())
    assert "RETURNING" not in take
    assert "sa_taskqueue_task.attempts = %s" in take, "fenced on the attempt seen"


def test_where_one_writer_runs_at_a_time_a_limited_claim_takes_all_its_candidates_in_one_update() -> None:
    # (Elsewhere each candidate has an UPDATE of its own, in (key, slot)
    # order, so that two claimers wait on each other's slots in one order.)
    take = compiled(take_statement(TABLE, REQUEST, 3), sqlite.dialect())
    assert take.count("UPDATE") == 1 and "RETURNING" not in take
    assert take.count("CASE") == 2, "each row its own key and slot"
    assert take.count("attempts =") >= 3, "each row fenced on its own attempt seen"


def test_a_deadlock_victim_is_told_from_other_errors() -> None:
    # InnoDB can end two claimers' wait for each other's slots as a deadlock;
    # the limited claim tries again then, as after a slot taken under it.
    class PyMySQLError(Exception):
        pass

    class PsycopgError(Exception):
        def __init__(self, sqlstate: str) -> None:
            self.sqlstate = sqlstate

    mysql_backend = backend_for(mysql.dialect())
    assert mysql_backend.lost_lock_race(PyMySQLError(1213, "Deadlock found when trying to get lock"))
    assert not mysql_backend.lost_lock_race(PyMySQLError(1054, "Unknown column"))
    postgres_backend = backend_for(postgresql.dialect())
    assert postgres_backend.lost_lock_race(PsycopgError("40P01"))
    assert not postgres_backend.lost_lock_race(PsycopgError("23505"))
    oracle_backend = backend_for(oracle.dialect())
    assert oracle_backend.lost_lock_race(Exception("ORA-00060: deadlock detected while waiting for resource"))
    assert not oracle_backend.lost_lock_race(Exception("ORA-00001: unique constraint (X.Y) violated"))


def test_failures_written_together_clear_and_free_their_slots(engine: sa.Engine, strategy_name: str) -> None:
    clock = MovableClock()
    queue = make_limited_queue(engine, strategy_name, timedelta(minutes=5), clock.now)
    try:
        enqueue(queue, engine, ["a"] * 4)
        held = queue.claim(limit=5)
        assert len(held) == LIMIT and queue.claim() == []
        assert all(task.concurrency_slot is not None for task in held)
        # Both go back to the queue to be retried, each row leaving its slot behind.
        assert queue.fail_many(held, ["boom"] * LIMIT) == {task.id for task in held}
        ids = [task.id for task in held]
        with engine.connect() as conn:
            left = conn.execute(
                sa.select(TABLE.c.status, TABLE.c.concurrency_slot).where(TABLE.c.id.in_(ids))
            ).all()
        assert sorted(left) == [(tq.TaskStatus.QUEUED, None)] * LIMIT, "no slot comes back with a later claim"
        clock.advance(timedelta(minutes=1))  # past their retry delays
        again = queue.claim(limit=5)
        slots = sorted(task.concurrency_slot or 0 for task in held)
        assert sorted(task.concurrency_slot or 0 for task in again) == slots, "the failed tasks' slots"
        assert max(running_per_key(engine).values()) <= LIMIT
    finally:
        queue.close()
