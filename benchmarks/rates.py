"""The claim with rate limits, beside the plain claim, in one run.

Three drains of the same number of no-op tasks through `QueueClient`'s
claim-and-complete loop:

- ``plain``: no rate limit anywhere (the claim every other section measures);
- ``registered``: the same tasks, with a rate-limited task registered but
  none of it queued, so claims also look for rate-limited tasks;
- ``rated``: every drained task is rate-limited, one rate key per
  ``TASKS_PER_KEY`` tasks, at a limit the drain never reaches, so it
  measures the windows' bookkeeping, not waiting for one.
"""

from __future__ import annotations

from benchmarks.backends import fresh_table
from benchmarks.drain import DrainResult, race, seed

#: The rated task's limit per key: far above what a key's tasks reach.
RATE_LIMIT = "1000/s"
#: Tasks per rate key.
TASKS_PER_KEY = 10
#: The drains, by the implementation that claims and whether the tasks are rated.
DRAINS = {
    "plain": ("sa_taskqueue", False),
    "registered": ("sa_taskqueue_rated", False),
    "rated": ("sa_taskqueue_rated", True),
}


def rates_drain(url: str, tasks: int, workers: int, batch: int, drain: str) -> DrainResult:
    """One run: a fresh table seeded as ``drain`` (of `DRAINS`) has it, ``workers`` processes."""
    implementation, rated = DRAINS[drain]
    fresh_table(url)
    if rated:
        seed_rated(url, tasks)
    else:
        seed(url, tasks)
    run = race(implementation, url, workers, batch)
    return DrainResult(
        seconds=max(run.finished - run.started, 1e-9),
        tasks=len(run.done),
        exactly_once=len(run.done) == tasks and len(set(run.done)) == tasks,
    ).with_costs(run.client_cpu, run.usage)


def seed_rated(url: str, count: int) -> None:
    """``count`` due tasks of the rated task, ``TASKS_PER_KEY`` to a key."""
    from datetime import UTC, datetime, timedelta

    import sqlalchemy as sa

    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    now = datetime.now(UTC)
    rows = [
        {
            "name": "rated",
            "queue": "default",
            "priority": 0,
            "params": {"key": f"k{index // TASKS_PER_KEY}"},
            "status": tq.TaskStatus.QUEUED,
            "run_at": now - timedelta(seconds=1),
            "attempts": 0,
            "max_attempts": 3,
            "created_at": now,
        }
        for index in range(count)
    ]
    with engine.begin() as conn:
        for start in range(0, count, 5000):
            conn.execute(tq.Task.__table__.insert(), rows[start : start + 5000])
    engine.dispose()
