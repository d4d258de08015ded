"""Drain throughput: N no-op tasks, W processes, claim batch B; tasks/s and an exactly-once check."""

from __future__ import annotations

import contextlib
import multiprocessing
import resource
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa

from benchmarks.backends import fresh_table
from benchmarks.clients import make_client
from benchmarks.costs import Meter, Usage
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
    """What the worker processes of one drain did, and what it cost."""

    started: float
    done: list[int]
    finished: float
    cycles_ms: list[float]
    client_cpu: float = 0.0
    usage: Usage = field(default_factory=Usage)


def _cpu_seconds() -> float:
    """This process's CPU time, every thread, and that of the children it has reaped (a worker's watchdog)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


class _TimedGo:
    """The start signal, noting this process's CPU time once its wait has returned."""

    def __init__(self, go: Any) -> None:
        self._go = go
        self.seen: float | None = None

    def wait(self, timeout: float | None = None) -> bool:
        answer = bool(self._go.wait(timeout))
        if answer and self.seen is None:
            self.seen = _cpu_seconds()
        return answer

    def is_set(self) -> bool:
        return bool(self._go.is_set())


class _Captured:
    """Stands in for the results queue: keeps the outcome, noting the CPU time when it is put."""

    def __init__(self) -> None:
        self.outcome: Any = None
        self.at: float | None = None

    def put(self, outcome: Any, *_args: Any, **_kwargs: Any) -> None:
        self.outcome = outcome
        self.at = _cpu_seconds()


def _timed(target: Any, args: tuple[Any, ...], ready: Any, go: Any, results: Any) -> None:
    """Run ``target`` in this worker process and put ``(outcome, CPU seconds from go to outcome)``."""
    timed_go, captured = _TimedGo(go), _Captured()
    target(*args, ready, timed_go, captured)
    if captured.at is None:
        raise RuntimeError(f"{target.__name__} put no outcome")
    cpu = 0.0 if timed_go.seen is None else captured.at - timed_go.seen
    results.put((captured.outcome, cpu))


class Together(NamedTuple):
    """What `start_together` returns."""

    started: float
    outcomes: list[Any]
    #: The worker processes' CPU seconds from the start signal to their outcomes, summed.
    client_cpu: float
    #: The server's usage over the same span, where metered.
    usage: Usage


def start_together(target: Any, args: tuple[Any, ...], workers: int, *, meter: str | None = None) -> Together:
    """Run ``target(*args, ready, go, results)`` in ``workers`` processes, released at one signal.

    Each process releases ``ready`` once set up, waits for ``go``, and puts
    one outcome on ``results``.  Returns when the signal went, the outcomes,
    and the processes' CPU time in between (`time.process_time`, and
    reaped children's).  With ``meter``, a database URL, its server is
    read just before the signal and just after the last outcome (`Meter`).
    """
    context = multiprocessing.get_context("spawn")
    ready = context.Semaphore(0)
    go = context.Event()
    results = context.Queue()
    processes = [
        context.Process(target=_timed, args=(target, args, ready, go, results)) for _ in range(workers)
    ]
    with contextlib.ExitStack() as stack:
        metered = stack.enter_context(Meter(meter)) if meter is not None else None
        for process in processes:
            process.start()
        for _ in processes:
            ready.acquire()
        if metered is not None:
            metered.start()
        started = time.perf_counter()
        go.set()
        timed = [results.get(timeout=600) for _ in processes]
        usage = metered.stop() if metered is not None else Usage()
    for process in processes:
        process.join()
    return Together(
        started=started,
        outcomes=[outcome for outcome, _cpu in timed],
        client_cpu=sum(cpu for _outcome, cpu in timed),
        usage=usage,
    )


def race(implementation: str, url: str, workers: int, batch: int) -> Race:
    """Start ``workers`` processes, let them drain the table at one signal, and collect what they did."""
    together = start_together(_drain_worker, (implementation, url, batch), workers, meter=url)
    outcomes = together.outcomes
    return Race(
        started=together.started,
        done=[task_id for ids, _, _ in outcomes for task_id in ids],
        finished=max(last for _, last, _ in outcomes),
        cycles_ms=[ms for _, _, cycles in outcomes for ms in cycles],
        client_cpu=together.client_cpu,
        usage=together.usage,
    )


@dataclass
class DrainResult:
    seconds: float
    tasks: int
    exactly_once: bool
    #: Claims and completion statements that took and wrote the tasks, where counted (`statements_used`).
    claims: int | None = None
    completions: int | None = None
    #: The worker processes' CPU seconds, the server's, and the statements it ran, over the run.
    client_cpu: float | None = None
    server_cpu: float | None = None
    statements: int | None = None
    #: Statements other databases on the server ran meanwhile, whose work is in `server_cpu`.
    elsewhere: int | None = None
    #: Why a cost figure is missing, as `benchmarks.costs` words it.
    cost_notes: frozenset[str] = frozenset()

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    @property
    def client_us(self) -> float | None:
        """Client CPU a task, µs."""
        return _per_task(self.client_cpu, self.tasks, 1e6)

    @property
    def server_us(self) -> float | None:
        """Server CPU a task, µs."""
        return _per_task(self.server_cpu, self.tasks, 1e6)

    @property
    def statements_per_task(self) -> float | None:
        return _per_task(self.statements, self.tasks, 1)

    def with_costs(self, client_cpu: float, usage: Usage) -> DrainResult:
        """This result with a run's costs: the client's CPU seconds and the server's `Usage`."""
        self.client_cpu = client_cpu
        self.server_cpu = usage.server_cpu
        self.statements = usage.statements
        self.elsewhere = usage.elsewhere
        self.cost_notes = usage.notes
        return self


def _per_task(total: float | None, tasks: int, scale: float) -> float | None:
    return None if total is None or not tasks else total / tasks * scale


def drain(implementation: str, url: str, tasks: int, workers: int, batch: int) -> DrainResult:
    """One run: fresh table, ``tasks`` tasks, ``workers`` processes racing to empty it."""
    fresh_table(url)
    seed(url, tasks)
    run = race(implementation, url, workers, batch)
    return DrainResult(
        seconds=max(run.finished - run.started, 1e-9),
        tasks=len(run.done),
        exactly_once=len(run.done) == tasks and len(set(run.done)) == tasks,
    ).with_costs(run.client_cpu, run.usage)


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
