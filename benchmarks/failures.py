"""Failing drains: a worker draining tasks that raise, beside the same worker draining tasks that return.

Each task may run once (``max_attempts=1``), so each failure is written
once, FAILED with its traceback, as the success beside it is written once,
COMPLETED.  Both drains run ``run_worker(concurrency=B, burst=True)`` in W
processes released together, and are timed to the last worker's return.  A
statement stamps every row it finishes with one ``finished_at``, so the
distinct values count the statements that wrote the outcomes.
"""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.clients import LEASE
from benchmarks.drain import seed, start_together

#: The two drains compared, each a run of the same worker over the same number of tasks.
OUTCOMES = ("succeed", "fail")


def _worker(url: str, batch: int, fail: bool, ready: Any, go: Any, results: Any) -> None:
    import sa_taskqueue as tq

    def numbered(n: int) -> int:
        if fail:
            raise ValueError(f"task {n} failed")
        return n

    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine, lease=LEASE)
    queue.task(name="noop")(numbered)
    queue.strategy  # noqa: B018 - connect and pick the strategy before the clock starts
    ready.release()
    go.wait()
    worker = queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05)
    ended = time.perf_counter()
    queue.close()
    engine.dispose()
    results.put((ended, worker.processed, worker.failed))


def outcome_drain(url: str, tasks: int, workers: int, batch: int, outcome: str) -> dict[str, Any]:
    """One drain of ``tasks`` tasks that all ``outcome`` ("succeed" or "fail"): its rate and statements."""
    import sa_taskqueue as tq

    fail = outcome == "fail"
    fresh_table(url)
    seed(url, tasks, numbered=True, max_attempts=1)
    started, ends, _client_cpu, _usage = start_together(_worker, (url, batch, fail), workers)
    seconds = max(max(ended for ended, _, _ in ends) - started, 1e-9)
    engine = sa.create_engine(url)
    table = tq.Task.__table__
    status = tq.TaskStatus.FAILED if fail else tq.TaskStatus.COMPLETED
    with engine.connect() as conn:
        finished = conn.scalar(sa.select(sa.func.count()).select_from(table).where(table.c.status == status))
        statements = conn.scalar(sa.select(sa.func.count(sa.distinct(table.c.finished_at))))
    engine.dispose()
    counted = sum(failed if fail else processed for _, processed, failed in ends)
    return {
        "rate": tasks / seconds,
        "statements": int(statements or 0),
        "exactly_once": finished == tasks and counted == tasks,
    }


__all__ = ["OUTCOMES", "outcome_drain"]
