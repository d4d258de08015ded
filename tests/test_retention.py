"""Retention: workers delete finished tasks older than their status's age, in batches, one at a time."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from sa_taskqueue.features import retention
from sa_taskqueue.features.admin import Admin
from tests.app import make_queue
from tests.backends import Backend
from tests.helpers import ROOT, MovableClock, wait_until

TABLE = tq.Task.__table__


def add_rows(engine: sa.Engine, tag: str, count: int, status: tq.TaskStatus, finished_at: object) -> None:
    """``count`` tasks in queue ``tag`` with this status and finished_at."""
    with Session(engine) as session:
        queue = make_queue(engine, None, timedelta(minutes=5))
        queue.enqueue_many(session, "record", ({"key": n} for n in range(count)), queue=tag)
        session.commit()
    with engine.begin() as conn:
        conn.execute(
            sa.update(TABLE).where(TABLE.c.queue == tag).values(status=status, finished_at=finished_at)
        )


def counts(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(TABLE.c.queue, sa.func.count()).group_by(TABLE.c.queue))
        return {str(queue): int(count) for queue, count in rows}


def test_retention_is_checked_when_the_queue_is_made() -> None:
    engine = sa.create_engine("sqlite://")
    day = timedelta(days=1)
    with pytest.raises(ValueError, match="retention keys must be finished statuses"):
        tq.TaskQueue(engine, retention={"queued": day})
    with pytest.raises(ValueError, match="retention keys must be finished statuses"):
        tq.TaskQueue(engine, retention={"done": day})
    with pytest.raises(TypeError, match=r"retention\['failed'\] must be a timedelta"):
        tq.TaskQueue(engine, retention={"failed": 3600})
    with pytest.raises(ValueError, match=r"retention\['completed'\] must be a positive timedelta"):
        tq.TaskQueue(engine, retention={tq.TaskStatus.COMPLETED: timedelta(0)})
    with pytest.raises(TypeError, match="retention must be a mapping"):
        tq.TaskQueue(engine, retention=[("completed", day)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="retention_interval must be a positive timedelta"):
        tq.TaskQueue(engine, retention={"completed": day}, retention_interval=timedelta(seconds=-1))
    queue = tq.TaskQueue(engine, retention={"completed": day, "failed": timedelta(minutes=5)})
    assert queue.retention_interval == timedelta(seconds=30), "a tenth of the shortest age"
    assert tq.TaskQueue(engine, retention={"completed": timedelta(days=30)}).retention_interval == timedelta(
        minutes=1
    )
    assert tq.TaskQueue(engine).retention_interval is None


def test_only_rows_older_than_their_status_age_are_deleted(engine: sa.Engine) -> None:
    clock = MovableClock()
    now = clock.now()
    add_rows(engine, "old-completed", 1200, tq.TaskStatus.COMPLETED, now - timedelta(days=2))
    add_rows(engine, "young-completed", 3, tq.TaskStatus.COMPLETED, now - timedelta(hours=1))
    add_rows(engine, "old-failed", 3, tq.TaskStatus.FAILED, now - timedelta(days=20))
    add_rows(engine, "young-failed", 3, tq.TaskStatus.FAILED, now - timedelta(days=2))
    # No entry for cancelled: kept however old.
    add_rows(engine, "old-cancelled", 3, tq.TaskStatus.CANCELLED, now - timedelta(days=100))
    # Not finished: never deleted, whatever finished_at says.
    add_rows(engine, "queued", 3, tq.TaskStatus.QUEUED, now - timedelta(days=100))
    add_rows(engine, "running", 3, tq.TaskStatus.RUNNING, now - timedelta(days=100))
    ages = {"completed": timedelta(days=1), "failed": timedelta(days=14)}
    queue = tq.TaskQueue(engine, clock=clock.now, retention=ages)
    batches: list[int] = []
    deleted = retention.delete_expired(
        engine, TABLE, queue.retention, holder="me", clock=clock.now, batch_size=500, on_batch=batches.append
    )
    assert deleted == 1203
    assert batches == [500, 500, 200, 3], "each batch at most batch_size rows"
    left = {"young-completed": 3, "young-failed": 3, "old-cancelled": 3, "queued": 3, "running": 3}
    assert counts(engine) == left
    assert queue.delete_expired() == 0, "nothing old left"
    clock.advance(timedelta(days=13))  # the young ones come of age
    assert queue.delete_expired() == 6
    assert counts(engine) == {"old-cancelled": 3, "queued": 3, "running": 3}


def test_the_dependency_edges_of_deleted_tasks_go_with_them(engine: sa.Engine) -> None:
    clock = MovableClock()
    queue = make_queue(engine, None, timedelta(minutes=5))
    with Session(engine) as session, session.begin():
        parent = queue.enqueue(session, "record", {"key": 1}, queue="old")
        old_child = queue.enqueue(session, "record", {"key": 2}, queue="old", depends_on=[parent])
        young_child = queue.enqueue(session, "record", {"key": 3}, queue="young", depends_on=[parent])
        ids = parent.id, old_child.id, young_child.id
    old_child_id, young_child_id = ids[1:]
    with engine.begin() as conn:
        conn.execute(
            sa.update(TABLE)
            .where(TABLE.c.id.in_(ids))
            .values(status=tq.TaskStatus.COMPLETED, finished_at=clock.now() - timedelta(hours=1))
        )
        conn.execute(
            sa.update(TABLE).where(TABLE.c.queue == "old").values(finished_at=clock.now() - timedelta(days=2))
        )
    edges = tq.Task.metadata.tables[f"{TABLE.name}_dependencies"]

    def children() -> list[int]:
        with engine.connect() as conn:
            return sorted(conn.scalars(sa.select(edges.c.child_id)))

    assert children() == sorted([old_child_id, young_child_id])
    queue = tq.TaskQueue(engine, clock=clock.now, retention={"completed": timedelta(days=1)})
    assert queue.delete_expired() == 2, "the old parent and the old child"
    assert children() == [young_child_id], "the deleted child's edge is gone; the other stays"
    clock.advance(timedelta(days=2))
    assert queue.delete_expired() == 1
    assert children() == []


def test_a_purge_by_hand_deletes_the_edges_of_the_tasks_it_deletes(engine: sa.Engine) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    with Session(engine) as session, session.begin():
        parent = queue.enqueue(session, "record", {"key": 1})
        child = queue.enqueue(session, "record", {"key": 2}, depends_on=[parent])
        ids = [parent.id, child.id]
    with engine.begin() as conn:
        conn.execute(
            sa.update(TABLE)
            .where(TABLE.c.id.in_(ids))
            .values(status=tq.TaskStatus.COMPLETED, finished_at=utcnow() - timedelta(days=8))
        )
    edges = tq.Task.metadata.tables[f"{TABLE.name}_dependencies"]
    assert Admin(engine, TABLE).purge(["completed"], timedelta(days=7)) == 2
    with engine.connect() as conn:
        assert conn.scalar(sa.select(sa.func.count()).select_from(edges)) == 0


def test_one_holder_of_the_lease_at_a_time(engine: sa.Engine) -> None:
    clock = MovableClock()
    assert retention.take_lease(engine, TABLE, "a", clock.now())
    assert retention.take_lease(engine, TABLE, "a", clock.now()), "its holder renews it"
    assert not retention.take_lease(engine, TABLE, "b", clock.now())
    queue = tq.TaskQueue(engine, clock=clock.now, retention={"completed": timedelta(days=1)})
    add_rows(engine, "old", 2, tq.TaskStatus.COMPLETED, clock.now() - timedelta(days=2))
    assert queue.delete_expired(holder="b") == 0, "another holds the lease"
    clock.advance(retention.LEASE)  # "a" died holding it: it runs out
    assert queue.delete_expired(holder="b") == 2
    assert retention.take_lease(engine, TABLE, "a", clock.now()), "given up by b when done"
    retention.release_lease(engine, TABLE, "a", clock.now())


def test_two_runs_in_one_process_do_not_share_the_lease(engine: sa.Engine) -> None:
    # Every worker of a process has the same worker id; each run still holds the lease alone.
    clock = MovableClock()
    queue = tq.TaskQueue(engine, clock=clock.now, retention={"completed": timedelta(days=1)})
    add_rows(engine, "old", 2, tq.TaskStatus.COMPLETED, clock.now() - timedelta(days=2))
    first = queue.default_worker_id()
    assert retention.take_lease(engine, TABLE, f"{first}:run1", clock.now())
    assert queue.delete_expired() == 0, "another run of this process holds it"
    retention.release_lease(engine, TABLE, f"{first}:run1", clock.now())
    assert queue.delete_expired() == 2


# Where a batch's rows come from a subquery.  (MySQL's DELETE ... LIMIT has
# its conditions on the rows it deletes, nothing else.)
@pytest.mark.backends("sqlite", "postgres", "postgres18", "oracle")
def test_a_task_put_back_in_the_queue_while_a_batch_waits_for_it_is_kept(engine: sa.Engine) -> None:
    clock = MovableClock()
    add_rows(engine, "old", 1, tq.TaskStatus.FAILED, clock.now() - timedelta(days=2))
    with engine.connect() as conn:
        (task_id,) = conn.execute(sa.select(TABLE.c.id)).scalars().all()
    deleted: list[int] = []
    retry = engine.connect()
    try:
        # A retry, not yet committed, holds the row's write lock (SQLite: the file's).
        retry.begin()
        retry.execute(
            sa.update(TABLE)
            .where(TABLE.c.id == task_id)
            .values(status=tq.TaskStatus.QUEUED, finished_at=None)
        )

        def purge() -> None:
            deleted.append(
                retention.delete_expired(
                    engine, TABLE, {tq.TaskStatus.FAILED: timedelta(days=1)}, holder="r", clock=clock.now
                )
            )

        batch = threading.Thread(target=purge)
        batch.start()
        wait_until(lambda: waiting_for_a_lock(engine) or not batch.is_alive(), 10, "the batch to wait")
        retry.commit()
        batch.join(timeout=30)
    finally:
        retry.close()
    assert deleted == [0]
    with engine.connect() as conn:
        assert conn.execute(sa.select(TABLE.c.status).where(TABLE.c.id == task_id)).scalar_one() == "queued"


def waiting_for_a_lock(engine: sa.Engine) -> bool:
    """Whether some session of the database waits for a row lock (PostgreSQL); True elsewhere."""
    if engine.dialect.name != "postgresql":
        return True  # SQLite: the batch waits on the file's write lock (its busy timeout)
    with engine.connect() as conn:
        query = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
        return bool(conn.exec_driver_sql(query).scalar())


def test_batch_delete_sql_per_database() -> None:
    status = tq.TaskStatus.COMPLETED
    on_mysql = str(
        retention.batch_delete(mysql.dialect(), TABLE, status, 500).compile(dialect=mysql.dialect())
    )
    assert on_mysql.endswith("LIMIT 500") and "IN (SELECT" not in on_mysql, on_mysql
    maria = sa.create_engine("mariadb+pymysql://").dialect
    assert str(retention.batch_delete(maria, TABLE, status, 500).compile(dialect=maria)).endswith("LIMIT 500")
    pg = postgresql.dialect()  # type: ignore[no-untyped-call]
    on_pg = str(retention.batch_delete(pg, TABLE, status, 500).compile(dialect=pg))
    assert "IN (SELECT" in on_pg and "LIMIT" in on_pg and "status = 'completed'" in on_pg, on_pg
    ora = oracle.dialect()  # type: ignore[no-untyped-call]
    on_oracle = str(retention.batch_delete(ora, TABLE, status, 500).compile(dialect=ora))
    assert "IN (SELECT" in on_oracle and "FETCH FIRST" in on_oracle and "LIMIT" not in on_oracle, on_oracle


RACER = """
import json, sys, time
from pathlib import Path
import sqlalchemy as sa
import sa_taskqueue as tq
from sa_taskqueue.features import retention
from sa_taskqueue.features.admin import Admin
from sa_taskqueue.core.control import control_table_of
from sa_taskqueue.core.types import utcnow

engine = sa.create_engine(sys.argv[1])
holder = sys.argv[3]
table = tq.Task.__table__
control = control_table_of(table)
batches = []

def on_batch(count):
    with engine.connect() as conn:
        held_by = conn.scalar(sa.select(control.c.held_by).where(control.c.kind == "retention"))
    batches.append((time.time(), count, held_by))

while not Path(sys.argv[2]).exists():
    time.sleep(0.005)
deleted = 0
for _ in range(20):
    deleted += retention.delete_expired(
        engine, table, {tq.TaskStatus.COMPLETED: retention.timedelta(days=1)},
        holder=holder, clock=utcnow, batch_size=50, on_batch=on_batch,
    )
print(json.dumps({"deleted": deleted, "batches": batches}))
"""


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_processes_racing_delete_each_row_once_one_holder_at_a_time(
    backend: Backend, engine: sa.Engine, tmp_path: Path
) -> None:
    rows = 3000
    add_rows(engine, "old", rows, tq.TaskStatus.COMPLETED, utcnow() - timedelta(days=2))
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, backend.url, str(go), f"racer-{n}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(3)
    ]
    go.touch()
    outputs = [racer.communicate(timeout=120) for racer in racers]
    for racer, (_out, err) in zip(racers, outputs, strict=True):
        assert racer.returncode == 0, err
    results = [json.loads(out) for out, _err in outputs]
    assert sum(result["deleted"] for result in results) == rows, "every old row, each once"
    assert counts(engine) == {}
    spans = []
    for n, result in enumerate(results):
        for _at, _count, held_by in result["batches"]:
            assert held_by == f"racer-{n}", "a batch runs only under its own lease"
        times = [at for at, count, _ in result["batches"] if count]
        if times:
            spans.append((min(times), max(times)))
    spans.sort()
    for (_, first_end), (second_start, _) in itertools.pairwise(spans):
        assert first_end < second_start, f"two processes deleted at once: {spans}"


def test_a_worker_drains_its_queue_while_it_deletes_a_large_backlog(engine: sa.Engine) -> None:
    add_rows(engine, "old", 5000, tq.TaskStatus.COMPLETED, utcnow() - timedelta(days=2))
    queue = tq.TaskQueue(
        engine, retention={"completed": timedelta(days=1)}, retention_interval=timedelta(seconds=0.2)
    )

    @queue.task(name="work")
    def work(key: int) -> int:
        return key

    with Session(engine) as session:
        queue.enqueue_many(session, "work", ({"key": n} for n in range(300)), queue="fresh")
        session.commit()
    worker = tq.Worker(queue, concurrency=2, poll_interval=0.1, watchdog=False)

    def drained() -> bool:
        with engine.connect() as conn:
            done = conn.scalar(
                sa.select(sa.func.count()).where(
                    TABLE.c.status == tq.TaskStatus.COMPLETED, TABLE.c.queue == "fresh"
                )
            )
        return done == 300 and counts(engine) == {"fresh": 300}

    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(drained, 60, "the fresh tasks to run and the old rows to go")
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert worker.processed == 300
    queue.close()


# Two applications, one table -------------------------------------------------------------


def test_a_worker_deletes_only_in_the_queues_it_serves(engine: sa.Engine) -> None:
    # One table holds the queues of two applications: the shop keeps finished tasks a day, the
    # billing application 90 days.  The shop's worker serves its queues only, and deletes there only.
    clock = MovableClock()
    old = clock.now() - timedelta(days=2)
    add_rows(engine, "shop.mail", 600, tq.TaskStatus.COMPLETED, old)
    add_rows(engine, "shop.orders", 3, tq.TaskStatus.FAILED, old)
    add_rows(engine, "billing.invoices", 4, tq.TaskStatus.COMPLETED, old)
    add_rows(engine, "billing.refunds", 2, tq.TaskStatus.FAILED, old)
    day = timedelta(days=1)
    shop = tq.TaskQueue(
        engine,
        clock=clock.now,
        retention={"completed": day, "failed": day},
        retention_interval=timedelta(seconds=0.1),
    )

    @shop.task(name="shop.send")
    def send() -> None:
        pass

    worker = tq.Worker(
        shop, queues=["shop.mail", "shop.orders"], concurrency=1, poll_interval=0.1, watchdog=False
    )
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: "shop.mail" not in counts(engine), 60, "the shop's worker to delete its old tasks")
        wait_until(lambda: "shop.orders" not in counts(engine), 10, "the shop's old failed tasks to go")
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert counts(engine) == {"billing.invoices": 4, "billing.refunds": 2}, "the other application's are kept"

    # The billing application's own retention, from a cron job: its queues, its ages.
    billing = tq.TaskQueue(engine, clock=clock.now, retention={"completed": timedelta(days=90)})
    billing_queues = ["billing.invoices", "billing.refunds"]
    assert billing.delete_expired(queues=billing_queues) == 0, "not 90 days old yet"
    clock.advance(timedelta(days=90))
    assert billing.delete_expired(queues=billing_queues) == 4, "completed ones only: no age for failed"
    assert counts(engine) == {"billing.refunds": 2}
    shop.close()
    billing.close()


def test_a_worker_serving_every_queue_deletes_in_every_queue(engine: sa.Engine) -> None:
    clock = MovableClock()
    add_rows(engine, "a", 2, tq.TaskStatus.COMPLETED, clock.now() - timedelta(days=2))
    add_rows(engine, "b", 3, tq.TaskStatus.COMPLETED, clock.now() - timedelta(days=2))
    queue = tq.TaskQueue(engine, clock=clock.now, retention={"completed": timedelta(days=1)})
    assert queue.delete_expired(queues=["a"]) == 2
    assert counts(engine) == {"b": 3}
    assert queue.delete_expired() == 3
    assert counts(engine) == {}
    queue.close()


def test_the_queues_retention_deletes_in_are_checked(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine, retention={"completed": timedelta(days=1)})
    with pytest.raises(TypeError, match="queues must be a sequence of queue names"):
        queue.delete_expired(queues="shop")
    with pytest.raises(ValueError, match="queues must name at least one queue"):
        queue.delete_expired(queues=[])
    with pytest.raises(ValueError, match="queue must be a non-empty string"):
        queue.delete_expired(queues=[""])
    queue.close()


def test_batch_delete_of_some_queues_reads_the_queue_per_database() -> None:
    status = tq.TaskStatus.COMPLETED
    for dialect in (mysql.dialect(), postgresql.dialect(), oracle.dialect()):  # type: ignore[no-untyped-call]
        sql = str(retention.batch_delete(dialect, TABLE, status, 500, ["shop"]).compile(dialect=dialect))
        assert "queue IN" in sql, sql
