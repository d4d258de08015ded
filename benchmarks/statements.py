"""What one claim and one completion cost the client: sa_taskqueue against the raw driver, call by call.

The drain tables give rates, which mix the client's work with the server's
and, with several processes on two cores, with the other processes'. Here
one process claims a seeded table B tasks at a time and completes each batch
in one call, through `TaskQueue.claim` and `TaskQueue.complete_many`, and
then through the raw batch client of the drain table on the same server.
Each call is timed on the wall clock and in the process's own CPU time
(`time.process_time`): the CPU is what the library adds over the driver,
the rest of the wall time the server and the round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from benchmarks.backends import analyze, fresh_table
from benchmarks.drain import seed
from benchmarks.raw_batch import make_batch_client

#: Batches claimed and completed before the clock starts: connections made, statements prepared.
WARM_UP_BATCHES = 5


@dataclass(frozen=True)
class StatementCosts:
    """Mean µs per call, on the wall clock and in the process's CPU time, over one drain of the table."""

    claim_wall: float
    claim_cpu: float
    complete_wall: float
    complete_cpu: float
    tasks: int
    batches: int

    def per_task(self, cpu: bool) -> float:
        """µs of one claim and one completion, shared among the tasks of a batch."""
        if cpu:
            return (self.claim_cpu + self.complete_cpu) * self.batches / self.tasks
        return (self.claim_wall + self.complete_wall) * self.batches / self.tasks


def statement_costs(
    implementation: str, url: str, tasks: int, batch: int, *, running: int = 0, analyzed: bool = False
) -> StatementCosts:
    """Drain a fresh table of ``tasks`` tasks, ``batch`` at a time, with ``implementation``'s batch client.

    ``running`` more tasks stay running all along under another worker's
    claim, with a day of lease left: the rows of a busy queue's long tasks,
    which a completion must not have to read past.  ``analyzed``: the
    planner's statistics are brought up to date once the table is filled.
    """
    fresh_table(url)
    if running:
        from sa_taskqueue import TaskStatus

        now = datetime.now(UTC)
        seed(
            url,
            running,
            status=TaskStatus.RUNNING,
            attempts=1,
            started_at=now,
            locked_by="a worker elsewhere",
            locked_until=now + timedelta(days=1),
        )
    seed(url, tasks + WARM_UP_BATCHES * batch)
    if analyzed:
        analyze(url)
    client = make_batch_client(implementation, url, batch)
    try:
        for _ in range(WARM_UP_BATCHES):
            client.complete_many([task_id for task_id, _params in client.claim()])
        claim_wall = claim_cpu = complete_wall = complete_cpu = 0.0
        done = batches = 0
        while True:
            wall, cpu = time.perf_counter(), time.process_time()
            claimed = client.claim()
            claim_wall += time.perf_counter() - wall
            claim_cpu += time.process_time() - cpu
            if not claimed:
                break
            wall, cpu = time.perf_counter(), time.process_time()
            client.complete_many([task_id for task_id, _params in claimed])
            complete_wall += time.perf_counter() - wall
            complete_cpu += time.process_time() - cpu
            done += len(claimed)
            batches += 1
    finally:
        client.close()
    if done != tasks:
        raise RuntimeError(f"drained {done} of {tasks} tasks")
    claims = batches + 1  # (the last, empty claim is timed too)
    return StatementCosts(
        claim_wall=claim_wall / claims * 1e6,
        claim_cpu=claim_cpu / claims * 1e6,
        complete_wall=complete_wall / batches * 1e6,
        complete_cpu=complete_cpu / batches * 1e6,
        tasks=done,
        batches=batches,
    )
