"""Pickup latency: from ``commit()`` returning to the task's first line, with one idle worker."""

from __future__ import annotations

import multiprocessing
import statistics
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from benchmarks.backends import fresh_table

_started: Any = None


def _record_start(key: int) -> None:
    _started.put((key, time.time()))


def _worker(url: str, listen: bool, poll_interval: float, started: Any, ready: Any, stop: Any) -> None:
    import threading

    import sa_taskqueue as tq

    global _started
    _started = started
    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine)
    queue.task(name="mark")(_record_start)
    worker = tq.Worker(queue, poll_interval=poll_interval, listen=listen, concurrency=2)
    threading.Thread(target=lambda: (stop.wait(), worker.stop()), daemon=True).start()
    queue.strategy  # noqa: B018 - connect first
    ready.set()
    worker.run()


def pickup_latency(url: str, listen: bool, samples: int, poll_interval: float = 1.0) -> list[float]:
    """Milliseconds from each enqueue's commit() returning to its task starting."""
    import sa_taskqueue as tq

    fresh_table(url)
    context = multiprocessing.get_context("spawn")
    started, ready, stop = context.Queue(), context.Event(), context.Event()
    process = context.Process(target=_worker, args=(url, listen, poll_interval, started, ready, stop))
    process.start()
    ready.wait(60)
    time.sleep(1.5)  # let the worker go idle (and, with LISTEN, start listening)
    engine = sa.create_engine(url)
    queue = tq.TaskQueue(engine)
    queue.task(name="mark")(_record_start)
    committed: dict[int, float] = {}
    for key in range(samples):
        with Session(engine) as session:
            queue.enqueue(session, "mark", {"key": key})
            session.commit()
        committed[key] = time.time()
        time.sleep(0.05)
    latencies = []
    for _ in range(samples):
        key, at = started.get(timeout=60)
        latencies.append(max(at - committed[key], 0.0) * 1000)
    stop.set()
    process.join(30)
    engine.dispose()
    return latencies


def percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    cuts = statistics.quantiles(ordered, n=100, method="inclusive")
    return {"p50": statistics.median(ordered), "p95": cuts[94], "p99": cuts[98]}
