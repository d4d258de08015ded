"""What one soak run found, and what makes it a failure.

- **executions**: runs of the soak task, from the execution log;
  **re-runs**: executions beyond the first of each task (at least once allows them).
- **overlapping**: tasks two of whose executions intersect in time, each
  execution lasting from its start line to its end line, or, when its process
  was killed before writing one, to the first moment its process was seen dead.
- **stale starts**: executions that began after a later attempt of their task
  had already begun elsewhere: a worker starting a task whose claim it had
  lost meanwhile (after a SIGSTOP, say).  Shown, not failed on: such a run
  overlaps nothing, and its outcome is refused.
- **lost**: tasks not COMPLETED when the run ended (FAILED ones included,
  also counted apart as **failed**), plus tasks COMPLETED without any execution
  that ran to its end.
- **left RUNNING**: rows still RUNNING when the run ended (before the workers
  were stopped, since stopping them gives running tasks back).
- **stall**: from the moment a fault strikes until the first task completes
  after it (its ``finished_at``): how long the queue as a whole stopped.
- **recover**: from the moment a fault strikes until the last of the tasks it
  struck completes: those running in the processes it struck (all workers,
  for the faults on the database) when it struck, begun or only claimed.
  So it includes what was left of their own run time (most take 0-20 ms, a
  few up to 1.25 leases) and, for a task taken from a worker, the lease.
  Both are read from the table's ``finished_at``, written with the workers'
  clock, the soak's own; the table shows the largest over the run's strikes.
- **run s**: from adding the tasks to the end of the drain.

A run fails when it shows any overlap, lost task or task left RUNNING, when
it ran out of time, when a worker did not stop within its shutdown time, or
when the soak's own record is in doubt (an execution not told its task, or
still running once every worker is stopped).
Workers that exited on their own (one that starts while the database is
down exits 1, as designed) are restarted and listed, without failing the run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.soak.events import Execution


@dataclass
class Injection:
    """One strike of a fault, and how the queue came back from it."""

    number: int
    at: float
    victim: int | None
    #: Tasks the fault struck: running (begun or only claimed) where and when it struck.
    affected: list[int]
    note: str = ""
    stall: float | None = None
    recovered: float | None = None


@dataclass
class RunResult:
    backend: str
    fault: str
    isolation: str
    tasks: int
    seconds: float = 0.0  # from adding the tasks to the end of the drain
    total_seconds: float = 0.0  # with the workers' start and stop
    executions: int = 0
    reruns: int = 0
    overlapping: int = 0
    overlaps: list[dict[str, Any]] = field(default_factory=list)
    stale_starts: int = 0
    lost: int = 0
    failed: int = 0
    completed_unexecuted: int = 0
    left_running: int = 0
    statuses_at_end: dict[str, int] = field(default_factory=dict)
    injections: list[Injection] = field(default_factory=list)
    injections_wanted: int = 0
    strikes_ended: str = ""  # why fewer strikes than wanted
    worker_restarts: int = 0
    unexpected_exits: list[str] = field(default_factory=list)
    hung_workers: list[str] = field(default_factory=list)
    unfinished_executions: int = 0
    unattributed_executions: int = 0
    timed_out: str = ""
    skipped: str = ""
    error: str = ""
    directory: str = ""

    @property
    def stall(self) -> float | None:
        return _largest(i.stall for i in self.injections)

    @property
    def recover(self) -> float | None:
        return _largest(i.recovered for i in self.injections)

    @property
    def problems(self) -> list[str]:
        """Why this run fails the soak; empty when it passes (or was skipped)."""
        if self.skipped:
            return []
        found = [
            f"{count} {what}"
            for count, what in (
                (self.overlapping, "task(s) with overlapping executions"),
                (self.lost, "lost task(s)"),
                (self.left_running, "task(s) left RUNNING"),
                (self.unfinished_executions, "execution(s) still running after the workers stopped"),
                (self.unattributed_executions, "execution(s) not told their task id"),
            )
            if count
        ]
        found.extend(self.hung_workers)
        if self.timed_out:
            found.append(self.timed_out)
        if self.error:
            found.append(self.error)
        return found

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(stall=self.stall, recover=self.recover, problems=self.problems, passed=not self.problems)
        return data


def _largest(values: Any) -> float | None:
    known = [value for value in values if value is not None]
    return max(known) if known else None


def overlapping_executions(executions: list[Execution]) -> list[tuple[Execution, Execution]]:
    """Pairs of executions of one task whose intervals intersect (an unfinished one lasts for ever)."""
    by_task: dict[int, list[Execution]] = defaultdict(list)
    for execution in executions:
        by_task[execution.task].append(execution)
    pairs = []
    for runs in by_task.values():
        runs.sort(key=lambda run: run.started)
        for index, first in enumerate(runs):
            first_end = first.finished if first.finished is not None else float("inf")
            for later in runs[index + 1 :]:
                if later.started < first_end:
                    pairs.append((first, later))
    return pairs


def stale_starts(executions: list[Execution]) -> int:
    """Executions begun after an execution of a later attempt of the same task had begun."""
    by_task: dict[int, list[Execution]] = defaultdict(list)
    for execution in executions:
        by_task[execution.task].append(execution)
    return sum(
        1
        for runs in by_task.values()
        for run in runs
        if any(other.attempt > run.attempt and other.started < run.started for other in runs)
    )


def describe(first: Execution, later: Execution) -> dict[str, Any]:
    """One overlap, for the JSON: both executions, and for how long they overlapped."""
    first_end = first.finished if first.finished is not None else None
    return {
        "task": first.task,
        "first": {**asdict(first), "finished": first_end},
        "later": {**asdict(later), "finished": later.finished},
        "overlap_s": None
        if first_end is None
        else min(first_end, later.finished or first_end) - later.started,
    }
