"""The workflow storm: a 10,000-member batch and a dependency graph drained while workers die and freeze.

Worker processes (`tests.storm_app`) drain a batch of 10,000 members (some
told to fail), and a graph of a few hundred nodes, each depending on up to
three earlier ones and all members of a second batch.  Meanwhile the test
SIGKILLs workers (and starts others) and SIGSTOPs them, half the stops
outlasting the lease, so their tasks are taken over and their late writes
must be fenced off.  At the end:

- every callback ran exactly once (its transactional row), and was enqueued once;
- no graph node started before all its parents had completed;
- each batch's counts equal its members' final statuses: every member counted once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import read_through_outages
from tests.storm_app import StormCallback, StormStart, make_storm_queue, reset

ROOT = Path(__file__).resolve().parent.parent

MEMBERS = 10_000
FAILING_MEMBERS = 20
NODES = 300
MAX_PARENTS = 3
WORKERS = 4
SLOTS = 4
LEASE = 2.0
#: Lost runs count as attempts; the storm loses many, and is about bookkeeping, not retries.
ATTEMPTS = 100
DEADLINE = 420.0


@pytest.fixture
def storm_engine(engine: sa.Engine) -> sa.Engine:
    reset(engine)
    return engine


def start_worker(backend: Backend, tmp_path: Path, n: int) -> subprocess.Popen[bytes]:
    log = open(tmp_path / f"worker-{n}.log", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.storm_app",
            "--url",
            backend.url,
            "--lease",
            str(LEASE),
            "--concurrency",
            str(SLOTS),
            "--name",
            f"w{n}",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def unfinished(engine: sa.Engine) -> int:
    table = tq.Task.__table__
    waiting = [tq.TaskStatus.WAITING, tq.TaskStatus.QUEUED, tq.TaskStatus.RUNNING]
    count = sa.select(sa.func.count()).where(table.c.status.in_(waiting))
    return int(read_through_outages(engine, lambda conn: conn.scalar(count)) or 0)


def member_statuses(engine: sa.Engine, batch_id: int) -> dict[str, int]:
    table = tq.Task.__table__
    members = table.c.batch_id == batch_id
    by_status = sa.select(table.c.status, sa.func.count()).where(members).group_by(table.c.status)
    rows = read_through_outages(engine, lambda conn: conn.execute(by_status).all())
    return {tq.TaskStatus(status).value: int(count) for status, count in rows}


@pytest.mark.slow  # starts processes and drains 10,000 tasks: each backend's full session runs it
def test_storm_callbacks_once_dependents_after_parents_members_counted_once(
    backend: Backend, storm_engine: sa.Engine, tmp_path: Path
) -> None:
    engine = storm_engine
    queue = make_storm_queue(engine, timedelta(seconds=LEASE))
    callback = queue.registered("callback")
    assert callback is not None
    rng = random.Random(20261129)

    # The graph, in one batch: each node depends on up to three of the 30 nodes before it.
    parents_of: dict[int, list[int]] = {}
    with Session(engine) as session:
        graph = queue.batch(
            session,
            "graph",
            on_success=(callback, {"outcome": "success"}),
            on_failure=(callback, {"outcome": "failure"}),
            on_complete=(callback, {"outcome": "complete"}),
        )
        assert isinstance(graph, tq.Batch)
        ids: list[int] = []
        for key in range(NODES):
            earlier = ids[max(0, key - 30) : key]
            parents = rng.sample(earlier, min(len(earlier), rng.randint(0, MAX_PARENTS)))
            task = queue.enqueue(
                session,
                "node",
                {"key": key, "parents": parents},
                depends_on=parents,
                batch=graph,
                max_attempts=ATTEMPTS,
            )
            ids.append(task.id)
            parents_of[key] = parents
        graph.close()
        # The big batch, its first half in this transaction.
        big = queue.batch(
            session,
            "big",
            on_success=(callback, {"outcome": "success"}),
            on_failure=(callback, {"outcome": "failure"}),
            on_complete=(callback, {"outcome": "complete"}),
        )
        assert isinstance(big, tq.Batch)
        half = MEMBERS // 2
        big.enqueue_many(
            queue.registered("member").using(max_attempts=ATTEMPTS),  # type: ignore[union-attr]
            [{"n": n} for n in range(half)],
        )
        session.commit()
    edges = sum(len(p) for p in parents_of.values())

    chaos = random.Random(20261130)
    started = time.monotonic()
    workers = {n: start_worker(backend, tmp_path, n) for n in range(WORKERS)}
    next_name = WORKERS
    stopped: dict[int, float] = {}
    kills = stops = 0
    added_rest = False
    try:
        while True:
            now = time.monotonic()
            assert now < started + DEADLINE, f"the storm did not end: {member_statuses(engine, big.id)}"
            if not added_rest and now > started + 3:
                # The other members, in a second transaction while the first are drained; then the close.
                with Session(engine) as session:
                    rest = queue.get_batch(session, big.id)
                    assert isinstance(rest, tq.Batch)
                    member = queue.registered("member")
                    assert member is not None
                    rest.enqueue_many(
                        member.using(max_attempts=ATTEMPTS),
                        [{"n": n} for n in range(half, MEMBERS - FAILING_MEMBERS)],
                    )
                    rest.enqueue_many(
                        member.using(max_attempts=1),
                        [{"n": n, "fail": True} for n in range(MEMBERS - FAILING_MEMBERS, MEMBERS)],
                    )
                    rest.close()
                    session.commit()
                added_rest = True
            if added_rest and unfinished(engine) == 0:
                break
            for n, resume_at in list(stopped.items()):
                if now >= resume_at:
                    workers[n].send_signal(signal.SIGCONT)
                    del stopped[n]
            running = [n for n in workers if n not in stopped]
            action = chaos.random()
            if action < 0.2 and len(running) > 1:
                victim = chaos.choice(running)
                workers.pop(victim).kill()
                kills += 1
                workers[next_name] = start_worker(backend, tmp_path, next_name)
                next_name += 1
            elif action < 0.6 and len(stopped) < 2 and len(running) > 2:
                victim = chaos.choice(running)
                workers[victim].send_signal(signal.SIGSTOP)
                # Half the stops outlast the lease: the tasks go to others meanwhile.
                stopped[victim] = now + chaos.uniform(0.3, 2 * LEASE + 1)
                stops += 1
            time.sleep(0.5)
    finally:
        for n, proc in workers.items():
            if n in stopped:
                proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - started

    big_state, graph_state = queue.batch_state(big.id), queue.batch_state(graph.id)
    big_members, graph_members = member_statuses(engine, big.id), member_statuses(engine, graph.id)
    with Session(engine) as session:
        callbacks = session.execute(
            sa.select(StormCallback.batch_id, StormCallback.outcome, StormCallback.total)
        ).all()
        starts = session.execute(sa.select(StormStart.node, StormStart.parents_completed)).all()
        callback_tasks = session.scalar(sa.select(sa.func.count()).where(tq.Task.name == "callback"))
    figures = (
        f"workflow storm on {backend.name}: {MEMBERS} members, {NODES} nodes, {edges} edges, {elapsed:.1f}s; "
        f"{kills} SIGKILLs, {stops} SIGSTOPs; big {big_members}, graph {graph_members}; "
        f"{len(starts)} node starts; callbacks {sorted(callbacks)}"
    )
    print(figures)
    assert kills >= 2 and stops >= 2, f"the storm barely struck: {figures}"
    # Every member counted once: the batch's own counts are its members' final statuses.
    for state, members in ((big_state, big_members), (graph_state, graph_members)):
        assert state.status == "finished", figures
        assert state.total == sum(members.values()), figures
        assert state.succeeded == members.get("completed", 0), figures
        assert state.failed == members.get("failed", 0), figures
        assert state.cancelled == members.get("cancelled", 0), figures
    assert big_state.total == MEMBERS and big_members.get("failed", 0) >= FAILING_MEMBERS, figures
    assert graph_state.total == NODES and graph_members == {"completed": NODES}, figures
    # Every callback enqueued once and run once: failure and complete for the big batch, success and
    # complete for the graph.
    assert callback_tasks == 4, figures
    assert sorted((batch_id, outcome) for batch_id, outcome, _ in callbacks) == sorted(
        [(big.id, "failure"), (big.id, "complete"), (graph.id, "success"), (graph.id, "complete")]
    ), figures
    assert all(total in (MEMBERS, NODES) for _, _, total in callbacks), figures
    # No node started before its parents completed, and every node started.
    assert {node for node, _ in starts} == set(range(NODES)), figures
    early = sorted(node for node, completed in starts if not completed)
    assert not early, f"nodes started before their parents completed: {early}; {figures}"
