"""Workers on several nodes of a live 3-node Galera cluster: each task once, few conflicts, none stranded.

Real worker processes (``sa-taskqueue worker``, 4 slots each) each on one
node's URL drain tasks enqueued on node 0.  Each task records its run in a
table of its own from the worker's node, so "ran exactly once" is what the
tasks committed, read back on node 0 once the cluster has applied every
write (``wsrep_sync_wait``).  Conflicts are the cluster's own count: the
transactions that failed certification or were aborted by a replicated one
(``wsrep_local_cert_failures`` + ``wsrep_local_bf_aborts``), summed over the
nodes.  The same drain without spreading proves that count sees conflicts.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import AppBase, Execution, make_queue
from tests.galera import GaleraCluster, galera_cluster
from tests.helpers import ROOT, cli_env, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.backends("mariadb")]

TABLE = tq.Task.__table__
#: Slots per worker, as in a first try of a cluster: one worker of 4 on each node.
SLOTS = 4


@pytest.fixture(scope="module")
def cluster() -> Iterator[GaleraCluster]:
    with galera_cluster(3) as running:
        yield running


@pytest.fixture
def nodes(cluster: GaleraCluster) -> Iterator[list[sa.Engine]]:
    """An engine per node, fresh tables; reads wait for the node to apply every write committed before."""
    engines = [
        sa.create_engine(url, connect_args={"init_command": "SET SESSION wsrep_sync_wait = 1"})
        for url in cluster.urls
    ]
    for metadata in (tq.metadata, AppBase.metadata):
        metadata.drop_all(engines[0])
        metadata.create_all(engines[0])
    yield engines
    for engine in engines:
        engine.dispose()


def conflicts(engines: list[sa.Engine]) -> int:
    """Transactions the cluster failed at commit or aborted for a replicated one, so far, over every node."""
    total = 0
    for engine in engines:
        with engine.connect() as conn:
            rows = conn.exec_driver_sql(
                "SHOW GLOBAL STATUS WHERE Variable_name IN"
                " ('wsrep_local_cert_failures', 'wsrep_local_bf_aborts')"
            ).all()
        total += sum(int(value) for _name, value in rows)
    return total


def enqueue(engine: sa.Engine, count: int, sleep: float = 0.0) -> None:
    queue = make_queue(engine, None, timedelta(minutes=5))
    with Session(engine) as session:
        for key in range(count):
            queue.enqueue(session, "record", {"key": key, "sleep": sleep})
        session.commit()


def worker(url: str, spreading: str, log: Path) -> subprocess.Popen[bytes]:
    """A worker of 4 slots on ``url``, with a 3s lease, its log to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sa_taskqueue",
                "worker",
                "tests.cli_app:queue",
                "--concurrency",
                str(SLOTS),
                "--poll-interval",
                "0.2",
                "--shutdown-timeout",
                "0",
            ],
            cwd=ROOT,
            env=cli_env(url, SA_TASKQUEUE_TEST_LEASE="3", SA_TASKQUEUE_TEST_SPREADING=spreading),
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def runs(engine: sa.Engine) -> dict[int, list[int]]:
    """task key -> the pids of the workers that ran it, one per run."""
    with engine.connect() as conn:
        rows = conn.execute(sa.select(Execution.task_key, Execution.pid)).all()
    found: dict[int, list[int]] = {}
    for key, pid in rows:
        found.setdefault(key, []).append(pid)
    return found


def unfinished(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count()).select_from(TABLE).where(TABLE.c.status != tq.TaskStatus.COMPLETED)
            ).scalar_one()
        )


def drain(
    cluster: GaleraCluster,
    engines: list[sa.Engine],
    tmp_path: Path,
    *,
    tasks: int,
    on: list[int],
    spreading: str = "on",
) -> tuple[dict[int, list[int]], dict[int, int], int]:
    """``tasks`` tasks enqueued on node 0 drained by one worker on each node of ``on``.

    Returns each key's runs, the node each worker pid ran on, and the conflicts the cluster counted.
    """
    enqueue(engines[0], tasks)
    before = conflicts(engines)
    with ExitStack() as stack:
        workers = {}
        for node in on:
            process = worker(cluster.urls[node], spreading, tmp_path / f"worker{node}.log")
            stack.callback(stop, process)
            workers[process.pid] = node
        wait_until(lambda: unfinished(engines[0]) == 0, 240, f"{tasks} tasks to finish", every=0.25)
    return runs(engines[0]), workers, conflicts(engines) - before


def logs(tmp_path: Path) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("*.log")))


def test_workers_on_every_node_run_each_task_once_with_few_conflicts_and_a_fair_share_each(
    cluster: GaleraCluster, nodes: list[sa.Engine], tmp_path: Path
) -> None:
    tasks = 900
    ran, workers, conflicted = drain(cluster, nodes, tmp_path, tasks=tasks, on=[0, 1, 2])
    assert sorted(ran) == list(range(tasks)), logs(tmp_path)
    assert all(len(pids) == 1 for pids in ran.values()), "a task ran twice"
    per_thousand = conflicted * 1000 / tasks
    assert per_thousand <= 10, f"{conflicted} conflicts in {tasks} tasks\n{logs(tmp_path)}"
    by_node = dict.fromkeys(workers.values(), 0)
    for pids in ran.values():
        by_node[workers[pids[0]]] += 1
    assert min(by_node.values()) >= tasks // 10, f"tasks per node: {by_node}"


def test_without_spreading_the_same_drain_conflicts(
    cluster: GaleraCluster, nodes: list[sa.Engine], tmp_path: Path
) -> None:
    """The conflict count can fail the test above: workers racing for one queue head conflict at once."""
    tasks = 300
    ran, _workers, conflicted = drain(cluster, nodes, tmp_path, tasks=tasks, on=[0, 1, 2], spreading="off")
    assert sorted(ran) == list(range(tasks)), logs(tmp_path)
    assert all(len(pids) == 1 for pids in ran.values()), "a task ran twice"
    assert conflicted > 0, logs(tmp_path)


def test_workers_on_one_node_take_every_share(
    cluster: GaleraCluster, nodes: list[sa.Engine], tmp_path: Path
) -> None:
    tasks = 300
    ran, _workers, _conflicted = drain(cluster, nodes, tmp_path, tasks=tasks, on=[1])
    assert sorted(ran) == list(range(tasks)), logs(tmp_path)
    assert all(len(pids) == 1 for pids in ran.values()), "a task ran twice"


def test_the_share_of_a_worker_killed_mid_drain_is_run_by_the_others(
    cluster: GaleraCluster, nodes: list[sa.Engine], tmp_path: Path
) -> None:
    tasks = 300
    enqueue(nodes[0], tasks, sleep=0.05)
    with ExitStack() as stack:
        processes = [
            worker(url, "on", tmp_path / f"worker{node}.log") for node, url in enumerate(cluster.urls)
        ]
        for process in processes:
            stack.callback(stop, process)
        victim = processes[2]
        wait_until(
            lambda: sum(victim.pid in pids for pids in runs(nodes[0]).values()) >= 20, 120, "node 2's worker"
        )
        victim.kill()
        victim.wait()
        assert _held_by(nodes[0], victim.pid), "it died holding tasks"
        wait_until(lambda: unfinished(nodes[0]) == 0, 240, "every task to finish", every=0.25)
    ran = runs(nodes[0])
    assert sorted(ran) == list(range(tasks)), logs(tmp_path)
    with nodes[0].connect() as conn:
        attempts = dict(conn.execute(sa.select(TABLE.c.id, TABLE.c.attempts)).all())
        keys = dict(conn.execute(sa.select(TABLE.c.id, TABLE.c.params)).all())
    again = {keys[task_id]["key"] for task_id, count in attempts.items() if count > 1}
    # Only a task the killed worker held may have run twice (its run had committed, its outcome not).
    assert {key for key, pids in ran.items() if len(pids) > 1} <= again
    assert all(len(pids) <= 2 for pids in ran.values())


def _held_by(engine: sa.Engine, pid: int) -> list[int]:
    """The running tasks of the worker process ``pid`` (a worker's id is ``host:pid:token``)."""
    with engine.connect() as conn:
        return list(
            conn.execute(
                sa.select(TABLE.c.id).where(
                    TABLE.c.status == tq.TaskStatus.RUNNING, TABLE.c.locked_by.like(f"%:{pid}:%")
                )
            ).scalars()
        )
