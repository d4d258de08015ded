"""A MariaDB Galera cluster (``--backend galera``): the capability, conflicts, the self-test, a node's crash.

The session runs a real 3-node cluster (tests/galera.py); ``backend.nodes``
are its nodes' URLs, node 0 first (the suite's own engine).  Row locks and
GET_LOCK are local to a node there: the cluster decides between two nodes'
writes to one row at commit (certification), failing the later one.
"""

from __future__ import annotations

import logging
import threading
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
from tests.txn_app import Effect, effects, reset

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
