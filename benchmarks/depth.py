"""Depth scaling: claim+complete latency with 10,000 queued tasks behind 0 to 1,000,000 finished rows."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from benchmarks.backends import analyze, fresh_table
from benchmarks.clients import TABLE
from benchmarks.drain import race, seed

COLUMNS = "name, queue, priority, params, status, run_at, attempts, max_attempts, created_at, finished_at"


def add_finished_rows(url: str, count: int) -> None:
    """Insert ``count`` completed/failed rows in one statement on the server."""
    if count == 0:
        return
    engine = sa.create_engine(url)
    backend = engine.dialect.name
    day_ago = (datetime.now(UTC) - timedelta(days=1)).replace(tzinfo=None)
    with engine.begin() as conn:
        if backend == "postgresql":
            conn.execute(
                sa.text(
                    f"INSERT INTO {TABLE} ({COLUMNS}) SELECT 'noop', 'default', 0, '{{}}', "
                    "CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'completed' END, now() - interval '1 day', "
                    "1, 3, now(), now() FROM generate_series(1, :n) AS g"
                ),
                {"n": count},
            )
        elif backend in ("mysql", "mariadb"):
            # MariaDB's Sequence engine makes seq_1_to_N tables on demand.
            conn.execute(
                sa.text(
                    f"INSERT INTO {TABLE} ({COLUMNS}) SELECT 'noop', 'default', 0, '{{}}', "
                    "IF(seq % 10 = 0, 'failed', 'completed'), :t, 1, 3, :t, :t "
                    f"FROM seq_1_to_{int(count)}"
                ),
                {"t": day_ago},
            )
        else:
            stamp = day_ago.isoformat(" ", "microseconds")
            conn.execute(
                sa.text(
                    f"INSERT INTO {TABLE} ({COLUMNS}) WITH RECURSIVE g(x) AS "
                    "(SELECT 1 UNION ALL SELECT x + 1 FROM g WHERE x < :n) "
                    "SELECT 'noop', 'default', 0, '{}', "
                    "CASE WHEN x % 10 = 0 THEN 'failed' ELSE 'completed' END, :t, 1, 3, :t, :t FROM g"
                ),
                {"n": count, "t": stamp},
            )
    engine.dispose()
    analyze(url)


def claim_latencies(
    url: str, finished: int, queued: int = 10_000, workers: int = 4, batch: int = 10
) -> list[float]:
    """Milliseconds per claim-and-complete cycle of ``batch`` tasks, over a full drain."""
    fresh_table(url)
    add_finished_rows(url, finished)
    seed(url, queued)
    run = race("sa_taskqueue", url, workers, batch)
    if len(set(run.done)) != queued:
        raise RuntimeError(f"{len(set(run.done))} of {queued} tasks drained")
    return run.cycles_ms


def claim_plan(url: str) -> str:
    """EXPLAIN of the claim statement, as the queue runs it."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    plan = tq.TaskQueue(engine).explain_claim(limit=10)
    engine.dispose()
    return plan
