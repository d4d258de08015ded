"""A MariaDB Galera cluster (``--backend galera``): the capability, conflicts, the self-test, a node's crash.

The session runs a real 3-node cluster (tests/galera.py); ``backend.nodes``
are its nodes' URLs, node 0 first (the suite's own engine).  Row locks and
GET_LOCK are local to a node there: the cluster decides between two nodes'
writes to one row at commit (certification), failing the later one.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import backend_for
from tests.backends import Backend
from tests.helpers import wait_until
from tests.txn_app import Effect, effects, make_txn_queue, reset

pytestmark = pytest.mark.backends("galera")

ROOT = Path(__file__).resolve().parent.parent
LEASE = timedelta(seconds=30)


@pytest.fixture
def txn_engine(engine: sa.Engine) -> sa.Engine:
    reset(engine)
    return engine


def node_engine(backend: Backend, n: int) -> sa.Engine:
    return sa.create_engine(backend.node_url(n), poolclass=sa.pool.NullPool)


# The capability ------------------------------------------------------------------------------


def test_each_node_is_found_to_be_a_galera_node_by_asking_the_server(backend: Backend) -> None:
    for n in range(len(backend.nodes)):
        engine = node_engine(backend, n)
        try:
            tq.TaskQueue(engine)  # (configures the engine: its first connect asks the server)
            # Before any connect the capability is not known, so not claimed.
            assert backend_for(engine.dialect).galera is False
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
            assert backend_for(engine.dialect).galera is True, f"node {n}"
        finally:
            engine.dispose()


def test_an_engine_that_connected_before_its_queue_learns_it_from_the_server_global_setting(
    backend: Backend,
) -> None:
    # Its first connect went by unwatched, and on that session replication is switched off: the
    # check reads the server's global setting, which a session's own cannot change.
    engine = node_engine(backend, 0)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SET SESSION wsrep_on = OFF")
            assert conn.exec_driver_sql("SELECT @@SESSION.wsrep_on").scalar() == 0
        queue = tq.TaskQueue(engine)
        assert queue.strategy.name == "skip_locked"  # (resolving it prepares the database)
        assert backend_for(engine.dialect).galera is True
        queue.close()
    finally:
        engine.dispose()


def test_a_deadlock_error_is_a_certification_conflict_only_on_a_galera_node(engine: sa.Engine) -> None:
    import pymysql

    deadlock = pymysql.err.OperationalError(
        1213, "Deadlock found when trying to get lock; try restarting transaction"
    )
    lock_wait = pymysql.err.OperationalError(1205, "Lock wait timeout exceeded; try restarting transaction")
    lost = pymysql.err.OperationalError(2013, "Lost connection to MySQL server during query")
    not_ready = pymysql.err.OperationalError(1047, "WSREP has not yet prepared node for application use")
    queue = tq.TaskQueue(engine)
    assert (
        queue.strategy.name == "skip_locked"
    )  # (resolving it has asked the server, as a worker's start does)
    queue.close()
    node = backend_for(engine.dialect)
    assert node.certification_conflict(deadlock)
    assert not node.certification_conflict(lock_wait) and not node.certification_conflict(lost)
    assert node.outage(not_ready), "a node outside the primary component serves again once synced"
    # The same MariaDB dialect, never connected to a Galera node: an InnoDB deadlock, not a conflict.
    plain = backend_for(sa.create_engine("mariadb+pymysql://").dialect)
    assert plain.lost_lock_race(deadlock) and not plain.certification_conflict(deadlock)
    assert plain.advisory_locks_not_exclusive() is None


def test_advisory_lock_is_refused_on_a_galera_node_saying_why(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine, strategy="advisory_lock")
    with pytest.raises(tq.StrategyError, match="GET_LOCK is held by one node only"):
        queue.claim()
    queue.close()


# The self-test ---------------------------------------------------------------------------------


def test_the_self_test_proves_exclusivity_across_two_nodes_when_given_a_second_one(
    backend: Backend, engine: sa.Engine
) -> None:
    queue = tq.TaskQueue(engine)
    try:
        report = queue.check_footing(listen=False, second_node=backend.nodes[1])
        [cluster] = [check for check in report.checks if check.name == "cluster"]
        assert cluster.passed, cluster.line()
        assert "one commit was certified" in cluster.detail
        alone = queue.check_footing(listen=False)
        [one_node] = [check for check in alone.checks if check.name == "cluster"]
        assert one_node.passed
        assert "one node cannot show" in one_node.detail and "--second-node" in one_node.detail
        same = queue.check_footing(listen=False, second_node=backend.nodes[0])
        [itself] = [check for check in same.checks if check.name == "cluster"]
        assert not itself.passed and "this very node" in itself.detail
    finally:
        queue.close()


# Certification conflicts --------------------------------------------------------------------------


def test_a_transactional_task_that_loses_a_certification_conflict_runs_again_its_attempt_not_counted(
    backend: Backend, txn_engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """The task updates a row on node 0 and waits in its transaction; node 1 commits the same row first.

    Node 1's write set, applied on node 0, aborts the task's transaction: its
    commit fails with a certification conflict.  The worker queues it again
    without counting the attempt, and the second run commits.
    """
    caplog.set_level(logging.DEBUG, "sa_taskqueue")
    with txn_engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS test_galera_counter")
        conn.exec_driver_sql("CREATE TABLE test_galera_counter (id INT PRIMARY KEY, n INT NOT NULL)")
        conn.exec_driver_sql("INSERT INTO test_galera_counter VALUES (1, 0)")
    queue = tq.TaskQueue(txn_engine, lease=LEASE)
    reached, opened = threading.Event(), threading.Event()
    runs: list[int] = []

    @queue.task(name="bump", transactional=True, max_attempts=1)
    def bump(session: Session) -> None:
        runs.append(1)
        session.execute(sa.text("UPDATE test_galera_counter SET n = n + 1 WHERE id = 1"))
        session.add(Effect(task_key=1))
        session.flush()
        if len(runs) == 1:
            reached.set()
            assert opened.wait(60)

    with Session(txn_engine) as session:
        task_id = queue.enqueue(session, "bump", {}).id
        session.commit()
    worker = tq.Worker(queue, concurrency=1, poll_interval=0.05, watchdog=False)
    thread = threading.Thread(target=worker.run)
    thread.start()
    other = node_engine(backend, 1)
    try:
        assert reached.wait(60), "the task did not start"
        with other.begin() as conn:  # certified first: the task's transaction has not committed
            conn.exec_driver_sql("UPDATE test_galera_counter SET n = n + 100 WHERE id = 1")
        opened.set()
        wait_until(
            lambda: _row(txn_engine, task_id).status == tq.TaskStatus.COMPLETED, 60, "the task to complete"
        )
    finally:
        opened.set()
        worker.stop()
        thread.join(60)
        other.dispose()
        queue.close()
    row = _row(txn_engine, task_id)
    with txn_engine.connect() as conn:
        counter = conn.exec_driver_sql("SELECT n FROM test_galera_counter WHERE id = 1").scalar()
        conn.exec_driver_sql("DROP TABLE test_galera_counter")
    assert len(runs) == 2, "the run that lost the conflict is run again"
    assert (row.attempts, row.max_attempts) == (1, 1), "its lost run did not spend its only attempt"
    assert counter == 101, "node 1's write and the second run's, not the first run's"
    assert effects(txn_engine) == {1: 1}
    assert "another node's transaction on the same rows won at commit" in caplog.text
    assert not [record for record in caplog.records if record.levelname in ("WARNING", "ERROR")], caplog.text


def _row(engine: sa.Engine, task_id: int) -> Any:
    with Session(engine) as session:
        return session.get(tq.Task, task_id)


# A node's crash in the middle of a drain ------------------------------------------------------------

FAULT_TASKS = 1500
#: Enqueued once the killed node is back.
FAULT_LATER = 1000
FAULT_SLOTS = 4
FAULT_LEASE = 3.0
FAULT_ATTEMPTS = 20
#: The node killed: not node 0, where the test reads.
VICTIM = 2


def start_txn_worker(backend: Backend, tmp_path: Path, n: int) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed with the process below
    args = ["--url", backend.node_url(n), "--lease", str(FAULT_LEASE), "--concurrency", str(FAULT_SLOTS)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.txn_app", *args, "--name", f"node{n}"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def completed_by(engine: sa.Engine) -> Counter[str]:
    """Completed tasks by the worker that completed them (its id's pid)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tq.Task.locked_by, sa.func.count())
            .where(tq.Task.status == tq.TaskStatus.COMPLETED)
            .group_by(tq.Task.locked_by)
        ).all()
    found: Counter[str] = Counter()
    for worker, count in rows:
        found[str(worker).split(":")[1] if worker else "?"] += count
    return found


def conflicts(backend: Backend, nodes: list[int]) -> int:
    """Certification failures and brute-force aborts the nodes counted since they started."""
    total = 0
    for n in nodes:
        engine = node_engine(backend, n)
        try:
            with engine.connect() as conn:
                rows = conn.exec_driver_sql(
                    "SHOW GLOBAL STATUS WHERE Variable_name IN "
                    "('wsrep_local_cert_failures', 'wsrep_local_bf_aborts')"
                ).all()
            total += sum(int(value) for _, value in rows)
        finally:
            engine.dispose()
    return total


@pytest.mark.slow  # starts processes and kills a node: run in the Galera session
def test_a_node_killed_in_the_middle_of_a_drain_loses_no_task_and_commits_each_effect_once(
    backend: Backend, txn_engine: sa.Engine, tmp_path: Path
) -> None:
    """Transactional tasks drained by a worker on each node; one node is SIGKILLed midway and restarted.

    The node rejoins by IST.  The other nodes' workers take over its
    worker's tasks when their leases end; once the node is back they are
    killed in turn and more tasks come, which the first worker, having
    waited out its outage, must drain alone.  Every task ends COMPLETED
    with exactly one effect row.
    """
    cluster = backend.cluster
    if cluster is None:
        pytest.skip("the cluster was given by URL: its nodes cannot be killed from here")
    queue = make_txn_queue(txn_engine, None, timedelta(seconds=FAULT_LEASE), bind=txn_engine)
    with Session(txn_engine) as session:
        tasks = ({"key": key, "pause": 0.01} for key in range(FAULT_TASKS))
        queue.enqueue_many(session, "effect", tasks, max_attempts=FAULT_ATTEMPTS)
        session.commit()
    queue.close()
    before = conflicts(backend, [0, 1])
    started = time.monotonic()
    workers = [start_txn_worker(backend, tmp_path, n) for n in range(len(backend.nodes))]
    victim_pid = str(workers[VICTIM].pid)

    def done() -> int:
        return completed_by(txn_engine).total()

    try:
        wait_until(lambda: done() >= FAULT_TASKS // 3, 180, "a third of the tasks to complete")
        at_kill = done()
        killed_at = time.monotonic()
        cluster.kill(VICTIM)
        # The others go on without it: the survivors drain a further share while it is down.
        wait_until(lambda: done() >= at_kill + FAULT_TASKS // 10, 120, "the surviving nodes to go on")
        cluster.start(VICTIM)  # returns once it is Synced again, by IST
        back_at = time.monotonic()
        by_victim_at_return = completed_by(txn_engine)[victim_pid]
        # The other nodes' workers go (their tasks come back when their leases end), and more work
        # comes: the killed node's worker, which waited out the outage, must drain it all.
        for n, proc in enumerate(workers):
            if n != VICTIM:
                proc.kill()
        more = make_txn_queue(txn_engine, None, timedelta(seconds=FAULT_LEASE), bind=txn_engine)
        with Session(txn_engine) as session:
            later = ({"key": key, "pause": 0.01} for key in range(FAULT_TASKS, FAULT_TASKS + FAULT_LATER))
            more.enqueue_many(session, "effect", later, max_attempts=FAULT_ATTEMPTS)
            session.commit()
        more.close()
        wait_until(
            lambda: completed_by(txn_engine)[victim_pid] > by_victim_at_return,
            120,
            "the killed node's worker to complete a task again",
        )
        resumed_after = time.monotonic() - back_at
        wait_until(lambda: done() >= FAULT_TASKS + FAULT_LATER, 300, "every task to complete")
        by_victim = completed_by(txn_engine)[victim_pid]
    finally:
        for proc in workers:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - started
    found = effects(txn_engine)
    with txn_engine.connect() as conn:
        attempts = dict(
            conn.execute(sa.select(tq.Task.attempts, sa.func.count()).group_by(tq.Task.attempts)).all()
        )
        statuses = dict(
            conn.execute(sa.select(tq.Task.status, sa.func.count()).group_by(tq.Task.status)).all()
        )
    logs = {n: (tmp_path / f"worker-{n}.log").read_text(errors="replace") for n in range(len(workers))}
    victim_log = logs[VICTIM]
    seen = sorted({line.split(" ", 3)[-1][:160] for line in victim_log.splitlines() if " ERROR " in line})
    total = FAULT_TASKS + FAULT_LATER
    figures = (
        f"{total} transactional tasks ({FAULT_LATER} of them enqueued once the node was back), "
        f"{len(workers)} workers of {FAULT_SLOTS} slots, one per node; node {VICTIM} SIGKILLed after "
        f"{at_kill} had completed, down {back_at - killed_at:.1f} s (kill to Synced again by IST); "
        f"drain {elapsed:.1f} s; attempts {attempts}; certification conflicts on the surviving nodes "
        f"{conflicts(backend, [0, 1]) - before}; the killed node's worker completed {by_victim_at_return} "
        f"tasks before the kill, its first again {resumed_after:.1f} s after its node was back, then, "
        f"alone, the other {by_victim - by_victim_at_return - 1} it found; "
        f"it logged {len(seen)} kind(s) of error: {seen}; "
        f"{sum(found.values())} effect rows for {len(found)} tasks"
    )
    print(figures)
    assert {tq.TaskStatus(status).value: count for status, count in statuses.items()} == {
        "completed": total
    }, figures
    assert by_victim - by_victim_at_return >= FAULT_LATER, (
        f"the killed node's worker did not drain: {figures}"
    )
    assert set(found) == set(range(total)), f"a task's writes were lost: {figures}"
    assert max(found.values()) == 1, f"a task's writes committed twice: {figures}"
    # (SQLAlchemy's pool logs, with its traceback, the reset of a connection the dead server dropped.)
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", "\n".join(logs.values()))
    tracebacks = [record for record in records if "Traceback" in record and "during reset" not in record]
    assert not tracebacks, "\n".join(tracebacks)[-5000:]
