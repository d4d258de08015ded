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


def claim_statements(url: str, tasks: int, batch: int, drain: str) -> dict[str, float]:
    """Statements and transactions the claims of one process send, a task, draining ``tasks`` as ``drain``.

    Counted in the client, on the queue's engine (each DBAPI execute, and
    each commit or rollback), while the claims run only: the completions
    are left out.  Unlike the server's counters, nothing else on the
    machine can change these figures.
    """
    import time

    from sqlalchemy import event

    from benchmarks.clients import QueueClient

    implementation, rated = DRAINS[drain]
    fresh_table(url)
    if rated:
        seed_rated(url, tasks)
    else:
        seed(url, tasks)
    client = QueueClient(url, batch, rated=implementation == "sa_taskqueue_rated")
    counting = False
    counts = {"statements": 0, "transactions": 0}

    def on_execute(*_args: object) -> None:
        if counting:
            counts["statements"] += 1

    def on_end(*_args: object) -> None:
        if counting:
            counts["transactions"] += 1

    event.listen(client.engine, "before_cursor_execute", on_execute)
    event.listen(client.engine, "commit", on_end)
    event.listen(client.engine, "rollback", on_end)
    done = empty = 0
    while empty < 3:
        counting = True
        claimed = client.claim()
        counting = False
        if not claimed:
            empty += 1
            time.sleep(0.01)
            continue
        empty = 0
        for task_id, _params in claimed:
            client.complete(task_id)
        done += len(claimed)
    client.close()
    return {key: value / max(done, 1) for key, value in counts.items()} | {"tasks": done}
