"""Drain throughput: N no-op tasks, W processes, claim batch B; tasks/s and an exactly-once check."""

from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.clients import make_client
from benchmarks.raw_batch import BATCHED, make_batch_client


def seed(url: str, count: int, *, numbered: bool = False, **overrides: Any) -> None:
    """Insert ``count`` due no-op tasks in one multi-row statement per chunk.

    ``numbered`` gives the i-th task the params ``{"n": i}``, for a task that records which ran.
    """
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    now = datetime.now(UTC)
    row = {
        "name": "noop",
        "queue": "default",
        "priority": 0,
        "params": {},
        "status": tq.TaskStatus.QUEUED,
        "run_at": now - timedelta(seconds=1),
        "attempts": 0,
        "max_attempts": 3,
        "created_at": now,
    }
    row.update(overrides)
    with engine.begin() as conn:
        for start in range(0, count, 5000):
            chunk = range(start, min(start + 5000, count))
            conn.execute(
                tq.Task.__table__.insert(),
                [{**row, "params": {"n": n}} for n in chunk] if numbered else [row] * len(chunk),
            )
    engine.dispose()


def _drain_worker(implementation: str, url: str, batch: int, ready: Any, go: Any, results: Any) -> None:
    batched = implementation in BATCHED
    if batched:
        client: Any = make_batch_client(implementation, url, batch)
    else:
        client = make_client(implementation, url, batch)
    ready.release()
    go.wait()
    done: list[int] = []
    cycles: list[float] = []  # ms per claim-and-complete of one batch
    last = time.perf_counter()
    empty = 0
    while empty < 3:
        cycle_started = time.perf_counter()
        tasks = client.claim()
        if not tasks:
            empty += 1
            time.sleep(0.01)
            continue
        empty = 0
        if batched:
            ids = [task_id for task_id, _params in tasks]
            client.complete_many(ids)  # type: ignore[attr-defined]
            done.extend(ids)
        else:
            for task_id, _params in tasks:
                client.complete(task_id)
                done.append(task_id)
        last = time.perf_counter()
        cycles.append((last - cycle_started) * 1000)
    client.close()
    results.put((done, last, cycles))


@dataclass
class Race:
    """What the worker processes of one drain did."""

    started: float
    done: list[int]
    finished: float
    cycles_ms: list[float]


def start_together(target: Any, args: tuple[Any, ...], workers: int) -> tuple[float, list[Any]]:
    """Run ``target(*args, ready, go, results)`` in ``workers`` processes, released at one signal.

    Each process releases ``ready`` once set up, waits for ``go``, and puts
    one outcome on ``results``.  Returns when the signal went, and the outcomes.
    """
    context = multiprocessing.get_context("spawn")
    ready = context.Semaphore(0)
    go = context.Event()
    results = context.Queue()
    processes = [context.Process(target=target, args=(*args, ready, go, results)) for _ in range(workers)]
    for process in processes:
        process.start()
    for _ in processes:
        ready.acquire()
    started = time.perf_counter()
    go.set()
    outcomes = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    return started, outcomes


def race(implementation: str, url: str, workers: int, batch: int) -> Race:
    """Start ``workers`` processes, let them drain the table at one signal, and collect what they did."""
    started, outcomes = start_together(_drain_worker, (implementation, url, batch), workers)
    return Race(
        started=started,
        done=[task_id for ids, _, _ in outcomes for task_id in ids],
        finished=max(last for _, last, _ in outcomes),
        cycles_ms=[ms for _, _, cycles in outcomes for ms in cycles],
    )


@dataclass
class DrainResult:
    seconds: float
    tasks: int
    exactly_once: bool
    #: Claims and completion statements that took and wrote the tasks, where counted (`statements_used`).
    claims: int | None = None
    completions: int | None = None

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds


def drain(implementation: str, url: str, tasks: int, workers: int, batch: int) -> DrainResult:
    """One run: fresh table, ``tasks`` tasks, ``workers`` processes racing to empty it."""
    fresh_table(url)
    seed(url, tasks)
    run = race(implementation, url, workers, batch)
    return DrainResult(
        seconds=max(run.finished - run.started, 1e-9),
        tasks=len(run.done),
        exactly_once=len(run.done) == tasks and len(set(run.done)) == tasks,
    )


def statements_used(url: str) -> tuple[int, int]:
    """How many claims took the drained tasks, and how many statements completed them.

    Read from the table after the drain, so nothing is counted while it
    runs: a claim stamps each of its rows with its worker and one
    ``started_at``, a completion statement with its worker and one
    ``finished_at``.
    """
    import sa_taskqueue as tq

    table = tq.Task.__table__
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            claims = conn.scalar(
                sa.select(sa.func.count()).select_from(
                    sa.select(table.c.locked_by, table.c.started_at).distinct().subquery()
                )
            )
            completions = conn.scalar(
                sa.select(sa.func.count()).select_from(
                    sa.select(table.c.locked_by, table.c.finished_at)
                    .where(table.c.finished_at.is_not(None))
                    .distinct()
                    .subquery()
                )
            )
    finally:
        engine.dispose()
    return int(claims or 0), int(completions or 0)
