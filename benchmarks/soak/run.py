"""One soak run: one backend, one fault, a fresh table of tasks drained by real workers while it strikes.

The fault strikes ``injections`` times, the k-th once k/(injections+1) of the
tasks are COMPLETED, whether or not the queue has recovered from the strike
before (a SIGSTOP is over, though), and only while tasks are running where it
strikes (a one-worker fault picks the worker holding the most).  It strikes
no more once fewer than two tasks per slot are queued, since the other
workers could no longer show whether the queue stalls; a queue that drains
early gets fewer strikes, and the report says how many it got.

Every wait is bounded: the run ends at ``run_timeout`` whatever state the
queue is in, and says so.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.backends import fresh_table
from benchmarks.soak.deaths import DeathWatch
from benchmarks.soak.events import Execution, ExecutionLog
from benchmarks.soak.faults import Fault, Injector, injector
from benchmarks.soak.results import Injection, RunResult, describe, overlapping_executions, stale_starts
from benchmarks.soak.server import WheelPostgres
from benchmarks.soak.table import TaskTable, durations, seed_tasks
from benchmarks.soak.workers import WorkerPool

#: The loop's turn: how often the execution log is read and the workers looked at.
TURN = 0.02
#: How often the table is read while the queue recovers from a fault, and otherwise.
POLL_RECOVERING = 0.1
POLL_STEADY = 0.25
#: The longest wait for every worker to connect, before any task is added.
READY_TIMEOUT = 120.0
#: How long, once the run is over, the final reads may be retried (a server coming back).
FINAL_READ_WINDOW = 30.0


@dataclass(frozen=True)
class SoakSettings:
    tasks: int
    lease: float
    workers: int
    concurrency: int
    injections: int
    stop_for: float
    run_timeout: float
    seed: int
    keep: bool


class SoakRun:
    """The state of one run while it goes: workers, log, deaths, table reads and injections."""

    def __init__(
        self,
        backend: str,
        url: str,
        fault: Fault,
        settings: SoakSettings,
        directory: Path,
        server: WheelPostgres | None,
    ) -> None:
        self.settings = settings
        self.fault = fault
        self.directory = directory
        self.log = ExecutionLog(directory / "executions.log")
        self.deaths = DeathWatch()
        self.table = TaskTable(url)
        self.pool = WorkerPool(
            settings.workers,
            settings.concurrency,
            fault.isolation,
            url,
            settings.lease,
            self.log.path,
            directory,
        )
        self.injector: Injector = injector(fault, self.pool, url, server, settings.stop_for)
        self.url = url
        self.result = RunResult(
            backend=backend,
            fault=fault.name,
            isolation=fault.isolation,
            tasks=settings.tasks,
            injections_wanted=0 if fault.kind == "none" else settings.injections,
            directory=str(directory),
        )
        self.counts: dict[str, int] = {}

    # The run -------------------------------------------------------------------

    def run(self) -> RunResult:
        """Start the workers on an empty table, add the tasks once all are ready, drain, and analyse.

        The tasks wait for the last worker, so that every worker has a share
        of them to be struck in, however slowly the machine starts Python.
        """
        started = time.time()
        fresh_table(self.url)
        sleeps = durations(self.settings.tasks, self.settings.lease, self.settings.seed)
        self.deaths.start()
        try:
            self.pool.start()
            for pid in self.pool.pids():
                self.deaths.watch(pid)
            if self._await_ready(started + self.settings.run_timeout):
                seeded = time.time()
                seed_tasks(self.url, sleeps)
                self._drain(started + self.settings.run_timeout)
                self.result.seconds = time.time() - seeded
            self._record_end_state()
        finally:
            self.injector.finish()
            self.pool.stop()
            self._await_deaths()
            self.deaths.stop()
            self.table.close()
        self._analyse()
        self.result.total_seconds = time.time() - started
        self.result.worker_restarts = self.pool.restarts()
        self.result.unexpected_exits = list(self.pool.unexpected_exits)
        self.result.hung_workers = list(self.pool.hung)
        return self.result

    def _await_ready(self, deadline: float) -> bool:
        """Wait for every worker to connect (restarting any that exit), at most until ``deadline``."""
        deadline = min(deadline, time.time() + READY_TIMEOUT)
        while time.time() < deadline:
            self._read_log()
            for worker in self.pool.restart_exited():
                self.deaths.watch(worker.pid)
            if all(pid in self.log.ready for pid in self.pool.pids()):
                return True
            if len(self.pool.unexpected_exits) > 2 * self.settings.workers:
                self.result.error = f"the workers keep exiting as they start (logs in {self.directory})"
                return False
            time.sleep(TURN)
        self.result.timed_out = "the workers were not all connected in time"
        return False

    def _drain(self, deadline: float) -> None:
        next_read = 0.0
        while True:
            now = time.time()
            self._read_log()
            for worker in self.pool.restart_exited():
                self.deaths.watch(worker.pid)
            self.injector.tick(now)
            if now >= next_read:
                counts = self.table.counts()
                if counts is not None:
                    self.counts = counts
                    self._follow_recovery()
                recovering = any(i.recovered is None for i in self.result.injections)
                next_read = now + (POLL_RECOVERING if recovering else POLL_STEADY)
            if self._drained() and not self.injector.active:
                return
            if now >= deadline:
                left = {k: v for k, v in sorted(self.counts.items()) if k != "completed"}
                self.result.timed_out = f"not drained within {self.settings.run_timeout:g}s (left: {left})"
                return
            self._maybe_inject()
            time.sleep(TURN)

    def _drained(self) -> bool:
        return (
            sum(self.counts.values()) == self.settings.tasks
            and self.counts.get("queued", 0) == 0
            and self.counts.get("running", 0) == 0
        )

    def _read_log(self) -> None:
        for execution in self.log.read_new():
            self.deaths.watch(execution.pid, execution.born)

    def _running(self) -> list[Execution]:
        """Executions still running now: no end line, and their process not seen dead."""
        for execution in self.log.open_executions():
            execution.died = self.deaths.died_at(execution.pid, execution.born)
        return self.log.open_executions()

    # Injections ------------------------------------------------------------------

    def _maybe_inject(self) -> None:
        done = len(self.result.injections)
        if done >= self.result.injections_wanted or self.injector.active or self.result.strikes_ended:
            return
        threshold = self.settings.tasks * (done + 1) / (self.result.injections_wanted + 1)
        if self.counts.get("completed", 0) < threshold:
            return
        before = self.table.counts()
        if before is None:
            return
        minimum = self.settings.workers * self.settings.concurrency * 2
        if before.get("queued", 0) < minimum:
            # Too little work left for the others to show whether the queue stalls.
            self.result.strikes_ended = f"no more strikes after {done}: fewer than {minimum} tasks queued"
            return
        victim: int | None = None
        if self.fault.one_worker:
            # The worker holding the most tasks, begun or only claimed.
            held = self.table.running_per_worker()
            held = {pid: count for pid, count in (held or {}).items() if pid in self.pool.pids()}
            if not held:
                return
            victim = max(held, key=held.__getitem__)
        elif not self._running():
            return
        claimed = self.table.running_ids()
        if claimed is None:
            return
        at = time.time()
        note = self.injector.inject(victim)
        if victim is not None:
            # What the struck worker held: claimed, whether or not begun.
            claimed = self.table.running_ids(victim) or []
        # Every line written before the strike is in the file by now.
        self._read_log()
        struck = {
            e.task
            for e in self.log.executions.values()
            if (victim is None or e.worker == victim)
            and e.started <= at
            and (e.ended is None or e.ended > at)
        }
        injection = Injection(done + 1, at, victim, sorted(struck | set(claimed)), note)
        self.result.injections.append(injection)

    def _follow_recovery(self) -> None:
        for injection in self.result.injections:
            if injection.stall is None:
                first = self.table.first_completion_after(injection.at)
                if first is not None:
                    injection.stall = first - injection.at
            if injection.recovered is None:
                if not injection.affected:
                    injection.recovered = 0.0
                    continue
                last = self.table.last_completion_of(injection.affected)
                if last is not None:
                    injection.recovered = max(last - injection.at, 0.0)

    # The end ---------------------------------------------------------------------

    def _record_end_state(self) -> None:
        """The statuses as the run ended, before stopping the workers gives running tasks back."""
        deadline = time.monotonic() + FINAL_READ_WINDOW
        counts = self.table.counts()
        while counts is None and time.monotonic() < deadline:
            time.sleep(0.5)
            counts = self.table.counts()
        if counts is None:
            self.result.error = "the table could not be read at the end of the run"
            return
        self.result.statuses_at_end = counts
        self.result.left_running = counts.get("running", 0)

    def _await_deaths(self) -> None:
        """Give the death watch time to see every stopped process gone (bounded)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self._read_log()
            if not self._running():
                break
            time.sleep(0.05)
        self._read_log()
        self._running()

    def _analyse(self) -> None:
        result = self.result
        executions = list(self.log.executions.values())
        result.executions = len(executions)
        result.reruns = len(executions) - len({e.task for e in executions})
        result.unfinished_executions = sum(1 for e in executions if e.finished is None)
        result.unattributed_executions = sum(1 for e in executions if e.task < 0)
        pairs = overlapping_executions(executions)
        result.overlapping = len({first.task for first, _ in pairs})
        result.overlaps = [describe(first, later) for first, later in pairs[:20]]
        result.stale_starts = stale_starts(executions)
        statuses = self._final_statuses()
        if statuses is None:
            result.error = result.error or "the task statuses could not be read after the run"
            return
        ran_to_end = {e.task for e in executions if e.ended is not None}
        completed = {task for task, status in statuses.items() if status == "completed"}
        result.failed = sum(1 for status in statuses.values() if status == "failed")
        result.completed_unexecuted = len(completed - ran_to_end)
        result.lost = len(statuses) - len(completed) + result.completed_unexecuted

    def _final_statuses(self) -> dict[int, str] | None:
        table = TaskTable(self.url)
        try:
            deadline = time.monotonic() + FINAL_READ_WINDOW
            statuses = table.statuses()
            while statuses is None and time.monotonic() < deadline:
                time.sleep(0.5)
                statuses = table.statuses()
            return statuses
        finally:
            table.close()


def soak_run(
    backend: str,
    url: str,
    fault: Fault,
    settings: SoakSettings,
    directory: Path,
    server: WheelPostgres | None,
) -> RunResult:
    """Run one backend/fault; its directory (logs, execution log) is kept only when it fails, or if asked."""
    directory.mkdir(parents=True, exist_ok=True)
    try:
        result = SoakRun(backend, url, fault, settings, directory, server).run()
    except Exception as error:  # noqa: BLE001 - one broken run is reported, the others still run
        result = RunResult(backend, fault.name, fault.isolation, settings.tasks, directory=str(directory))
        result.error = f"the run failed: {type(error).__name__}: {error}"
    if not result.problems and not settings.keep:
        shutil.rmtree(directory, ignore_errors=True)
        result.directory = ""
    return result
