"""What a worker costs beside its statements: `run_worker` with the database answered from memory.

The drain and peers tables time a worker whose claims and completions go to a
server; the statements section times those calls alone.  What is left is the
worker's own work for each task: handing it to a slot's thread, the lease
bookkeeping and the watchdog's deadline, gathering successes into one write,
freeing the slot, and the thread switches in between.  Here a queue's
`claim`, `complete_many`, `complete` and `complete_many_and_claim` answer from memory (claimed tasks
built by `ClaimedTask`'s constructor, a few µs dearer than a real claim's
rows, every success reported written), so a worker's run is that work
alone, in the process's CPU time.  Each figure includes the run's start and
stop (the watchdog process, the threads), about 1 µs a task at the default
20,000 tasks.

It runs in a process of its own for each figure, so that one run's threads,
watchdog and garbage leave nothing behind for the next.
"""

from __future__ import annotations

import itertools
import multiprocessing
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from benchmarks.observability import TRACEPARENT, observe

#: Lease of the in-memory claims: long enough that no heartbeat renews one during a run.
LEASE = timedelta(minutes=5)


@dataclass(frozen=True)
class WorkerCost:
    """One worker's run over ``tasks`` no-op tasks with ``batch`` slots, nothing sent to a database."""

    tasks: int
    seconds: float
    cpu_seconds: float  # the process's user and system time, every thread
    switches: int  # voluntary context switches: a thread waiting on another

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    @property
    def cpu_per_task_us(self) -> float:
        return self.cpu_seconds / self.tasks * 1e6

    @property
    def switches_per_task(self) -> float:
        return self.switches / self.tasks


def _memory_queue(tasks: int, observed: str = "off") -> Any:
    """A `TaskQueue` on an engine it never uses, whose claims and writes never leave the process."""
    import sa_taskqueue as tq
    from sa_taskqueue.core.claimed import ClaimedTask

    ids = itertools.count(1)
    now = datetime.now(UTC)
    # Tasks enqueued under a trace carry its context, which a traced run continues.
    headers = '{"traceparent": "%s"}' % TRACEPARENT if observed == "on" else None  # noqa: UP031

    class MemoryQueue(tq.TaskQueue):
        left = tasks

        def claim(self, limit: int = 1, **options: Any) -> list[ClaimedTask]:
            taken = min(limit, self.left)
            self.left -= taken
            worker = options.get("worker_id") or "worker"
            return [
                ClaimedTask(
                    id=next(ids),
                    name="noop",
                    queue="default",
                    priority=0,
                    params={},
                    attempts=1,
                    max_attempts=3,
                    run_at=now,
                    created_at=now,
                    started_at=now,
                    locked_by=worker,
                    locked_until=now + LEASE,
                    raw_headers=headers,
                )
                for _ in range(taken)
            ]

        def complete_many(
            self, claimed: Sequence[ClaimedTask], results: Sequence[Any] | None = None
        ) -> set[int]:
            return {task.id for task in claimed}

        def complete(self, claimed: ClaimedTask, result: Any = None) -> bool:
            return True

        def complete_many_and_claim(
            self, claimed: Sequence[ClaimedTask], results: Sequence[Any] | None = None, **claim: Any
        ) -> tuple[set[int], list[ClaimedTask]]:
            # A worker's write of a batch's successes with the next claim: both from memory too.
            claim.pop("limited_recheck", None)
            return self.complete_many(claimed, results), self.claim(**claim)

    queue = MemoryQueue(sa.create_engine("sqlite://"), lease=LEASE)
    queue.task(name="noop")(lambda: None)
    if observed != "off":
        queue.observed_by = observe(queue, observed)
    return queue


def _run(tasks: int, batch: int, results: Any, observed: str = "off") -> None:
    queue = _memory_queue(tasks, observed)
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    worker = queue.run_worker(concurrency=batch, burst=True, poll_interval=0.05, self_test=False)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    provider = getattr(queue, "observed_by", None)
    if provider is not None:
        provider.shutdown()  # (the spans still batched are handed over: their cost is counted too)
        after = resource.getrusage(resource.RUSAGE_SELF)
        seconds = time.perf_counter() - started
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    results.put(WorkerCost(worker.processed, seconds, cpu, after.ru_nvcsw - before.ru_nvcsw))


def worker_cost(tasks: int, batch: int, observed: str = "off") -> WorkerCost:
    """Run one worker over ``tasks`` in-memory tasks with ``batch`` slots, in a fresh process.

    ``observed`` is a mode of `benchmarks.observability.MODES`: metrics and tracing off, or on.
    """
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_run, args=(tasks, batch, results, observed))
    process.start()
    cost: WorkerCost = results.get(timeout=600)
    process.join()
    if cost.tasks != tasks:
        raise RuntimeError(f"the worker ran {cost.tasks} of {tasks} tasks")
    return cost
