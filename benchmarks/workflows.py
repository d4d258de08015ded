"""What workflows cost: plain tasks beside batch members and dependents, counted statement by statement.

One process enqueues N no-op tasks and drains them through `TaskQueue.claim`
and `TaskQueue.complete_many`, B at a time, in each of these ways, on a
fresh table:

- ``plain (bulk)``: one ``enqueue_many`` of N tasks;
- ``batch members (bulk)``: one batch, its N members by one ``batch.enqueue_many``, closed;
- ``plain (one by one)``: N ``enqueue`` calls, in one transaction;
- ``dependents (one by one)``: N/2 parents, then N/2 dependents each
  ``depends_on`` one parent (N/2 edges), by ``enqueue`` calls in one transaction.

Statements are counted by SQLAlchemy's cursor events on the queue's engine
(PostgreSQL's COPY, which ``enqueue_many`` uses from 50 rows, is not a
cursor statement and is not counted); CPU is the process's own
(`time.process_time`).  The cost of a member is the batch's figure less the
plain bulk one, per task; the cost of an edge is the dependents' figure
less the plain one-by-one one, per edge.  The plain drains also give the
plain claim and completion's statements and CPU a task, which workflows
must leave as they were.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

#: The ways the N tasks are enqueued, in the order they are measured.
KINDS = ("plain_bulk", "batch_bulk", "plain_single", "dependent_single")
LABELS = {
    "plain_bulk": "plain (bulk)",
    "batch_bulk": "batch members (bulk)",
    "plain_single": "plain (one by one)",
    "dependent_single": "dependents (one by one)",
}


@dataclass(frozen=True)
class WorkflowCost:
    """Statements and µs of CPU a task, to enqueue and to drain (claim + complete), over one run."""

    kind: str
    tasks: int
    edges: int
    enqueue_statements: float
    enqueue_cpu: float
    drain_statements: float
    drain_cpu: float

    def as_json(self) -> dict[str, Any]:
        return dict(vars(self))


class _Counter:
    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        sa.event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        self.count += 1


def workflow_cost(url: str, kind: str, tasks: int, batch: int) -> WorkflowCost:
    """``tasks`` no-op tasks enqueued the ``kind`` way in a fresh table, then drained ``batch`` at a time."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    tq.metadata.drop_all(engine)
    tq.metadata.create_all(engine)
    queue = tq.TaskQueue(engine)

    @queue.task(name="noop")
    def noop() -> None:
        return None

    counter = _Counter(engine)
    edges = 0
    # Connect and warm up outside the measurement.
    with Session(engine) as session:
        session.execute(sa.select(1))
    start_statements, start_cpu = counter.count, time.process_time()
    with Session(engine) as session:
        if kind == "plain_bulk":
            queue.enqueue_many(session, "noop", [{}] * tasks)
        elif kind == "batch_bulk":
            with queue.batch(session, "bench") as members:  # type: ignore[union-attr]
                members.enqueue_many("noop", [{}] * tasks)
        elif kind == "plain_single":
            for _ in range(tasks):
                queue.enqueue(session, "noop", {})
        elif kind == "dependent_single":
            parents = [queue.enqueue(session, "noop", {}).id for _ in range(tasks // 2)]
            for parent in parents:
                queue.enqueue(session, "noop", {}, depends_on=[parent])  # type: ignore[call-arg]
            edges = len(parents)
        else:
            raise ValueError(f"unknown kind {kind!r}")
        session.commit()
    enqueue_statements, enqueue_cpu = counter.count - start_statements, time.process_time() - start_cpu
    warm = queue.claim(limit=1)  # warm: the strategy resolved, its statements prepared
    queue.complete_many(warm)
    start_statements, start_cpu = counter.count, time.process_time()
    done = len(warm)
    pending = queue.claim(limit=batch)
    while pending:
        queue.complete_many(pending)
        done += len(pending)
        pending = queue.claim(limit=batch)
    drain_statements, drain_cpu = counter.count - start_statements, time.process_time() - start_cpu
    queue.close()
    engine.dispose()
    if done < tasks:
        raise RuntimeError(f"{kind}: drained {done} of {tasks} tasks")
    return WorkflowCost(
        kind=kind,
        tasks=tasks,
        edges=edges,
        enqueue_statements=enqueue_statements / tasks,
        enqueue_cpu=enqueue_cpu * 1e6 / tasks,
        drain_statements=drain_statements / tasks,
        drain_cpu=drain_cpu * 1e6 / tasks,
    )


#: The kinds a library without workflows can run: what ``--baseline-source`` measures again.
PLAIN_KINDS = ("plain_bulk", "plain_single")


def baseline_cost(source: str, url: str, kind: str, tasks: int, batch: int) -> WorkflowCost:
    """`workflow_cost` of the library at ``source`` (another checkout, e.g. the release before), in a child.

    This file runs as a script there, with ``source`` first on the path, so
    the child imports that checkout's ``sa_taskqueue`` and nothing else of
    this one: the same measurement, before and after, in one run.
    """
    child = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), url, kind, str(tasks), str(batch)],
        env={**os.environ, "PYTHONPATH": str(Path(source).resolve())},
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if child.returncode != 0:
        raise RuntimeError(f"the baseline run at {source} failed: {child.stderr[-2000:]}")
    return WorkflowCost(**json.loads(child.stdout.strip().splitlines()[-1]))


def derived(costs: dict[str, WorkflowCost]) -> dict[str, float]:
    """The cost of one batch member and of one dependency edge, from one run's figures."""
    plain, member = costs["plain_bulk"], costs["batch_bulk"]
    single, dependent = costs["plain_single"], costs["dependent_single"]
    per_edge = dependent.tasks / max(dependent.edges, 1)
    return {
        "member_statements": (member.enqueue_statements + member.drain_statements)
        - (plain.enqueue_statements + plain.drain_statements),
        "member_cpu": (member.enqueue_cpu + member.drain_cpu) - (plain.enqueue_cpu + plain.drain_cpu),
        "edge_statements": (
            (dependent.enqueue_statements + dependent.drain_statements)
            - (single.enqueue_statements + single.drain_statements)
        )
        * per_edge,
        "edge_cpu": ((dependent.enqueue_cpu + dependent.drain_cpu) - (single.enqueue_cpu + single.drain_cpu))
        * per_edge,
    }


__all__ = ["KINDS", "LABELS", "PLAIN_KINDS", "WorkflowCost", "baseline_cost", "derived", "workflow_cost"]

if __name__ == "__main__":  # the child of `baseline_cost`: URL KIND TASKS BATCH
    print(json.dumps(workflow_cost(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])).as_json()))
