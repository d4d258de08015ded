"""The claim with the scheduling controls in use, beside the plain claim, in one run.

Each side drains the same number of no-op tasks through `QueueClient`'s
claim-and-complete loop.  The controlled sides have every control a team
would have switched on at once:

- every drained task carries a unique key (its row holds an index entry in
  ``ux_<table>_unique`` while queued or running);
- a task with a concurrency limit is registered, so claims also look for
  limited tasks: in ``controls`` one drained task in ``LIMITED_EVERY`` is
  of it, in ``limited`` half of them are (one key per ``TASKS_PER_KEY``
  tasks, a limit the drain never reaches, so it measures the slots'
  bookkeeping, not waiting for one);
- a paused queue holds ``PAUSED_TASKS`` due tasks ahead of the others in
  claim order, which the claim must pass by.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.drain import DrainResult, race

#: Due tasks left waiting in a paused queue during the controlled drain.
PAUSED_TASKS = 1000
PAUSED_QUEUE = "paused"
#: The concurrency limit of the limited task: above what W x B can hold at once.
LIMIT = 100
#: Tasks per concurrency key.
TASKS_PER_KEY = 10
#: In the ``controls`` drain, one task in this many is limited; in ``limited``, one in two.
LIMITED_EVERY = 100
#: The drains: plain, and the two controlled ones, by how often a drained task is limited.
DRAINS = {"plain": 0, "controls": LIMITED_EVERY, "limited": 2}


def seed_controlled(url: str, count: int, limited_every: int) -> None:
    """``count`` due keyed tasks, one in ``limited_every`` limited, and a paused queue's worth of tasks."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    table = tq.Task.__table__
    now = datetime.now(UTC)
    base = {
        "queue": "default",
        "priority": 0,
        "status": tq.TaskStatus.QUEUED,
        "run_at": now - timedelta(seconds=1),
        "attempts": 0,
        "max_attempts": 3,
        "created_at": now,
    }
    rows: list[dict[str, Any]] = []
    for index in range(count):
        limited = index % limited_every == limited_every - 1
        key = f"k{index // TASKS_PER_KEY}"
        rows.append(
            {
                **base,
                "name": "limited" if limited else "noop",
                "params": {"key": key} if limited else {},
                "unique_key": f"u{index}",
                # What the limited task derives from its params at enqueue.
                "concurrency_key": limited_key(key) if limited else None,
            }
        )
    # The paused queue's tasks come first in claim order: the claim passes them by.
    paused = [
        {**base, "name": "noop", "params": {}, "queue": PAUSED_QUEUE, "run_at": now - timedelta(seconds=2)}
        for _ in range(PAUSED_TASKS)
    ]
    with engine.begin() as conn:
        for batch in (paused, rows):
            for start in range(0, len(batch), 5000):
                conn.execute(table.insert(), batch[start : start + 5000])
    queue = tq.TaskQueue(engine)
    queue.pause(PAUSED_QUEUE)
    queue.close()
    engine.dispose()


def limited_key(key: str) -> str:
    """The concurrency key the limited task's enqueue stores for ``key``, as the library derives it."""
    import sa_taskqueue as tq
    from benchmarks.clients import register_controlled

    queue = tq.TaskQueue(sa.create_engine("sqlite://"))
    register_controlled(queue)
    limit = queue.registered("limited").options.concurrency  # type: ignore[union-attr]
    assert limit is not None
    return limit.key_of({"key": key})


def controls_drain(url: str, tasks: int, workers: int, batch: int, drain: str) -> DrainResult:
    """One run: a fresh table seeded as ``drain`` (of `DRAINS`) has it, ``workers`` processes."""
    from benchmarks.drain import seed

    fresh_table(url)
    limited_every = DRAINS[drain]
    if limited_every:
        seed_controlled(url, tasks, limited_every)
    else:
        seed(url, tasks)
    run = race("sa_taskqueue_controls" if limited_every else "sa_taskqueue", url, workers, batch)
    return DrainResult(
        seconds=max(run.finished - run.started, 1e-9),
        tasks=len(run.done),
        exactly_once=len(run.done) == tasks and len(set(run.done)) == tasks,
    ).with_costs(run.client_cpu, run.usage)
