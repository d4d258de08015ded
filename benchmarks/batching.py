"""What batching successes costs a task: how long its success waits for its write, and its result's delay.

A worker's successes wait up to ``completion_delay`` for the other tasks it
has claimed, to be written in one statement, and a slot is freed only once
its success is written.  Two runs show the price, each with the delay at
0, at 1 ms (the default) and at 5 ms:

- **drains**: a worker with 10 slots (``burst=True``) draining no-op tasks,
  then tasks that sleep 0 to 20 ms.  Each task returns the time it ended;
  the row's ``finished_at`` is the time its statement was sent, so the
  difference is how long the success waited, and the distinct
  ``finished_at`` values count the statements.
- **beside a slow task**: one worker (4 slots) runs a task that sleeps
  throughout, while no-op probes are enqueued 50 ms apart.  A probe's success
  may wait for the slow task, up to the delay: its statement is sent that
  much later (the figures leave out the statement's own round trip).  Pickup
  (commit to start) is shown beside it.

The worker polls every 50 ms (and listens on PostgreSQL), so that pickup
does not hide a few milliseconds.  Every time here is read from one
machine's clock by the worker's process and the enqueuing one.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from benchmarks.backends import fresh_table

#: The delays compared: writing each batch as soon as none is under way, and the default.
DELAYS = (0.0, 0.001, 0.005)
DRAIN_SLOTS = 10
#: The drains: (label, tasks, longest task in ms); a drain's tasks take 0, 1, ... ms, in turn.
WORKLOADS = (("no-op", 5000, 0), ("0-20 ms", 2000, 20))
PROBE_SLOTS = 4
PROBE_SPACING = 0.05
#: How long the slow task runs: longer than any run of probes (checked), given back at the end.
HOLD_SECONDS = 3600.0
POLL_INTERVAL = 0.05


def _sleep_then_stamp(ms: int) -> float:
    if ms:
        time.sleep(ms / 1000)
    return time.time()


def _stamp() -> float:
    return time.time()


def _hold(seconds: float) -> None:
    time.sleep(seconds)


def _queue(url: str) -> Any:
    import sa_taskqueue as tq

    queue = tq.TaskQueue(sa.create_engine(url))
    queue.task(name="work")(_sleep_then_stamp)
    queue.task(name="probe")(_stamp)
    queue.task(name="hold")(_hold)
    return queue


def _worker(url: str, concurrency: int, delay: float, burst: bool, ready: Any, stop: Any) -> None:
    import threading

    import sa_taskqueue as tq

    queue = _queue(url)
    worker = tq.Worker(
        queue,
        concurrency=concurrency,
        burst=burst,
        poll_interval=POLL_INTERVAL,
        completion_delay=delay,
        shutdown_timeout=0.5,  # (the slow task is given back at the end, not waited for)
    )
    threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
    queue.strategy  # noqa: B018 - connect first
    ready.set()
    worker.run()
    if worker.abandoned:
        os._exit(0)  # the slow task's thread sleeps on: leave it, as the command line does
    queue.close()
    queue.engine.dispose()


def _start_worker(url: str, concurrency: int, delay: float, *, burst: bool) -> tuple[Any, Any]:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    process = context.Process(target=_worker, args=(url, concurrency, delay, burst, ready, stop))
    process.start()
    if not ready.wait(60):
        raise RuntimeError("the worker did not start within 60 s")
    return process, stop


def _finished_rows(url: str, name: str) -> list[tuple[Any, datetime | None, Any]]:
    """(status, finished_at, result) of every task called ``name``."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    try:
        with Session(engine) as session:
            rows = session.execute(
                sa.select(tq.Task.status, tq.Task.finished_at, tq.Task.result).where(tq.Task.name == name)
            ).all()
    finally:
        engine.dispose()
    return [(row.status, row.finished_at, row.result) for row in rows]


def _all_completed(rows: list[tuple[Any, datetime | None, Any]], expected: int) -> bool:
    import sa_taskqueue as tq

    return len(rows) == expected and all(status == tq.TaskStatus.COMPLETED for status, _, _ in rows)


def timed_drain(url: str, delay: float, tasks: int, longest_ms: int) -> dict[str, Any]:
    """Drain ``tasks`` tasks of 0 to ``longest_ms`` ms on 10 slots: successes' waits, and the statements."""
    fresh_table(url)
    queue = _queue(url)
    with Session(queue.engine) as session:
        queue.enqueue_many(session, "work", [{"ms": n % (longest_ms + 1)} for n in range(tasks)])
        session.commit()
    queue.close()
    queue.engine.dispose()
    process, _stop = _start_worker(url, DRAIN_SLOTS, delay, burst=True)
    process.join(600)
    if process.exitcode != 0:
        raise RuntimeError(f"the drain's worker exited with {process.exitcode}")
    rows = _finished_rows(url, "work")
    ended = [(at.timestamp(), end) for _, at, end in rows if at is not None and end is not None]
    finished = [at for at, _ in ended]
    return {
        "delay_ms": delay * 1000,
        # From the first task's end to the last statement: the worker's start is left out.
        "rate": len(ended) / (max(finished) - min(end for _, end in ended)),
        "statements": len(set(finished)),
        "wait": _spread_ms([(at - end) * 1000 for at, end in ended]),
        "exactly_once": _all_completed(rows, tasks),
    }


def beside_a_slow_task(url: str, delay: float, samples: int) -> dict[str, Any]:
    """Probes enqueued 50 ms apart while a slow task runs: their pickup, and when their successes are sent."""
    import sa_taskqueue as tq

    fresh_table(url)
    process, stop = _start_worker(url, PROBE_SLOTS, delay, burst=False)
    engine = sa.create_engine(url)
    queue = _queue(url)
    try:
        with Session(engine) as session:
            hold = queue.enqueue(session, "hold", {"seconds": HOLD_SECONDS})
            session.commit()
            hold_id = hold.id
        time.sleep(1.0)  # the slow task is running, and the worker listening
        committed: dict[int, float] = {}
        for _ in range(samples):
            with Session(engine) as session:
                task = queue.enqueue(session, "probe", {})
                session.commit()
                committed[task.id] = time.time()
            time.sleep(PROBE_SPACING)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            rows = _probe_rows(engine)
            if all(
                status != tq.TaskStatus.QUEUED and status != tq.TaskStatus.RUNNING for _, status, _, _ in rows
            ):
                break
            time.sleep(0.1)
        with Session(engine) as session:
            if session.get_one(tq.Task, hold_id).status != tq.TaskStatus.RUNNING:
                raise RuntimeError("the slow task was not running beside every probe")
    finally:
        stop.set()
        process.join(60)
        if process.is_alive():
            process.kill()
            process.join()
        queue.close()
        queue.engine.dispose()
    rows = _probe_rows(engine)
    engine.dispose()
    # (A probe that failed has a finish time and no result: left out, and "all once" says no.)
    done = [
        (committed[task_id], at.timestamp(), ran)
        for task_id, _, at, ran in rows
        if at is not None and ran is not None
    ]
    return {
        "delay_ms": delay * 1000,
        "pickup": _spread_ms([(ran - commit) * 1000 for commit, _, ran in done]),
        "sent": _spread_ms([(at - commit) * 1000 for commit, at, _ in done]),
        "wait": _spread_ms([(at - ran) * 1000 for _, at, ran in done]),
        "exactly_once": len(done) == samples
        and all(status == tq.TaskStatus.COMPLETED for _, status, _, _ in rows),
    }


def _probe_rows(engine: sa.Engine) -> list[tuple[int, Any, datetime | None, Any]]:
    import sa_taskqueue as tq

    with Session(engine) as session:
        rows = session.execute(
            sa.select(tq.Task.id, tq.Task.status, tq.Task.finished_at, tq.Task.result).where(
                tq.Task.name == "probe"
            )
        ).all()
    return [(row.id, row.status, row.finished_at, row.result) for row in rows]


def _spread_ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": statistics.median(ordered), "p95": cuts[94], "max": ordered[-1]}
