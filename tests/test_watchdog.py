"""No task runs twice at once while its worker process exists: GIL-holding tasks, SIGSTOP, partitions.

Each test lets a worker claim a task, takes away the worker's means of
renewing the lease (the GIL, the CPU, the network), and starts a second
worker that claims the task once the lease has ended.  Every run of the
task logs its start and end (tests.app's ``span`` task); a run that never
ended ends when its process was first seen dead.  No run may begin before
the previous run of the same task has ended.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import StreamLines, enqueue_one, start_cli, task_row, wait_until
from tests.link import Link

#: Short, so that a lease runs out within seconds.
LEASE = 3.0

pytestmark = pytest.mark.slow


@dataclass
class Run:
    key: int
    pid: int
    start: float
    end: float | None


def runs(spans: Path) -> list[Run]:
    """The task runs logged so far, in the order they started."""
    started: dict[tuple[int, int], Run] = {}
    for line in spans.read_text().splitlines() if spans.exists() else []:
        event, key, pid, at = line.split()
        if event == "start":
            started[(int(key), int(pid))] = Run(int(key), int(pid), float(at), None)
        else:
            started[(int(key), int(pid))].end = float(at)
    return sorted(started.values(), key=lambda run: run.start)


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone, or going while read
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")  # a zombie runs nothing


class Deaths:
    """The first moment each watched process was seen dead, polled every few milliseconds."""

    def __init__(self) -> None:
        self._watched: set[int] = set()
        self._dead: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def watch(self, pid: int) -> None:
        with self._lock:
            self._watched.add(pid)

    def dead_at(self, pid: int) -> float | None:
        with self._lock:
            return self._dead.get(pid)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            with self._lock:
                alive = self._watched - self._dead.keys()
            for pid in alive:
                if _gone(pid):
                    with self._lock:
                        self._dead[pid] = time.time()


def assert_never_twice_at_once(spans: Path, deaths: Deaths) -> None:
    by_key: dict[int, list[Run]] = {}
    for run in runs(spans):
        by_key.setdefault(run.key, []).append(run)
    for key, key_runs in by_key.items():
        for earlier, later in itertools.pairwise(key_runs):
            ended = earlier.end if earlier.end is not None else deaths.dead_at(earlier.pid)
            assert ended is not None, f"run of task {key} in process {earlier.pid} never ended"
            assert ended <= later.start, (
                f"task {key} started again in process {later.pid} "
                f"{ended - later.start:.2f}s before its run in process {earlier.pid} ended"
            )


def worker(url: str, spans: Path, *args: str) -> tuple[subprocess.Popen[str], StreamLines]:
    process = start_cli(
        "worker",
        "tests.cli_app:queue",
        "--poll-interval",
        "0.1",
        *args,
        url=url,
        SA_TASKQUEUE_TEST_LEASE=str(LEASE),
        SA_TASKQUEUE_TEST_SPANS=str(spans),
    )
    return process, StreamLines(process.stderr)


@pytest.fixture
def spans(tmp_path: Path) -> Path:
    return tmp_path / "spans"


@pytest.fixture
def deaths() -> Iterator[Deaths]:
    watcher = Deaths()
    yield watcher
    watcher.stop()


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Worker processes to kill at the end, whatever happened."""
    started: list[subprocess.Popen[str]] = []
    yield started
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def first_run(spans: Path) -> Run:
    found: list[Run] = []
    wait_until(lambda: found.extend(runs(spans)) or found, 60, "the first worker to start the task")
    return found[0]


def completed_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        query = sa.select(sa.func.count()).where(tq.Task.status == tq.TaskStatus.COMPLETED)
        return conn.execute(query).scalar_one()


def completed(engine: sa.Engine, task_id: int) -> bool:
    return task_row(engine, task_id).status == tq.TaskStatus.COMPLETED


def test_a_task_holding_the_gil_past_its_lease_is_never_run_beside_its_worker(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
) -> None:
    params = {"key": 1, "seconds": 3 * LEASE, "hold_gil": True}
    task_id = enqueue_one(default_queue, engine, "span", params)
    first, first_log = worker(backend.url, spans)
    processes.append(first)
    deaths.watch(first.pid)
    run = first_run(spans)
    assert run.pid == first.pid
    second, _ = worker(backend.url, spans)
    processes.append(second)
    wait_until(lambda: completed(engine, task_id), 60, "the second worker to complete the task")
    assert first.wait(30) == -signal.SIGKILL, "the watchdog killed the worker its task starved"
    first_log.wait_for(lambda line: "watchdog" in line, 10, "the watchdog to say why it killed")
    assert len(runs(spans)) == 2
    assert_never_twice_at_once(spans, deaths)


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_stopped_worker_and_its_task_are_dead_before_its_lease_ends(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
    isolation: str,
) -> None:
    task_id = enqueue_one(default_queue, engine, "span", {"key": 1, "seconds": 3 * LEASE})
    first, _ = worker(backend.url, spans, "--isolation", isolation)
    processes.append(first)
    deaths.watch(first.pid)
    run = first_run(spans)
    deaths.watch(run.pid)  # the worker itself, or its task's child process
    os.kill(first.pid, signal.SIGSTOP)
    second, _ = worker(backend.url, spans, "--isolation", isolation)
    processes.append(second)
    wait_until(lambda: completed(engine, task_id), 60, "the second worker to complete the task")
    assert first.wait(30) == -signal.SIGKILL
    assert len(runs(spans)) == 2
    assert_never_twice_at_once(spans, deaths)


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_a_worker_cut_off_from_the_database_is_dead_before_its_lease_ends(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
    link: Link,
) -> None:
    task_id = enqueue_one(default_queue, engine, "span", {"key": 1, "seconds": 3 * LEASE})
    first, _ = worker(link.url(backend.url), spans)
    processes.append(first)
    deaths.watch(first.pid)
    first_run(spans)
    link.freeze()  # the partition: the worker's statements go unanswered
    second, _ = worker(backend.url, spans)
    processes.append(second)
    wait_until(lambda: completed(engine, task_id), 60, "the second worker to complete the task")
    assert first.wait(30) == -signal.SIGKILL
    assert len(runs(spans)) == 2
    assert_never_twice_at_once(spans, deaths)


@pytest.mark.backends("postgres", "mysql", "mariadb")
@pytest.mark.parametrize(
    "cut",
    [
        pytest.param(Link.sever, id="every-renewal-fails-at-once"),
        pytest.param(Link.freeze, id="every-renewal-hangs"),
    ],
)
def test_a_task_process_whose_lease_cannot_be_renewed_is_stopped_and_its_worker_lives_on(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
    link: Link,
    cut: Callable[[Link], None],
) -> None:
    task_id = enqueue_one(default_queue, engine, "span", {"key": 1, "seconds": 3 * LEASE})
    first, first_log = worker(link.url(backend.url), spans, "--isolation", "process")
    processes.append(first)
    run = first_run(spans)
    deaths.watch(run.pid)
    cut(link)
    first_log.wait_for(lambda line: "its process was stopped" in line, 30, "the worker to stop its task")
    wait_until(lambda: deaths.dead_at(run.pid) is not None, 10, "the task's process to end")
    link.restore()  # (a frozen link stays frozen: the first worker waits on its statements)
    second, _ = worker(backend.url, spans, "--isolation", "process")
    processes.append(second)
    wait_until(lambda: completed(engine, task_id), 60, "the second worker to complete the task")
    assert first.poll() is None, "the worker itself lives on"
    assert len(runs(spans)) == 2
    assert_never_twice_at_once(spans, deaths)


@pytest.mark.backends("postgres", "mysql", "mariadb")
def test_a_task_process_worker_cut_off_once_its_tasks_have_ended_lives_on(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
    link: Link,
) -> None:
    # Tasks shorter than a heartbeat on four slots: when the partition comes,
    # a renewal hangs, and the tasks claimed just before it end meanwhile.
    # With none left running, nothing can run twice: the watchdog must not
    # act on the deadline of tasks that have ended.
    count = 40
    for key in range(count):
        enqueue_one(default_queue, engine, "span", {"key": key, "seconds": 0.1 * LEASE})
    first, _ = worker(link.url(backend.url), spans, "--isolation", "process", "--concurrency", "4")
    processes.append(first)
    deaths.watch(first.pid)
    wait_until(lambda: len(runs(spans)) >= 6, 60, "the worker to run a few tasks")
    link.freeze()
    cut_at = time.monotonic()
    wait_until(lambda: all(run.end is not None for run in runs(spans)), 10, "the running tasks to end")
    # The watchdog would act within one lease of the last renewal; watch for two.
    while time.monotonic() < cut_at + 2 * LEASE:
        assert first.poll() is None, "the watchdog killed a worker with no task running"
        time.sleep(0.05)
    # The partition ends as a lasting one does, the server dropping the cut-off
    # worker's sessions: a frozen link would keep them, and a transaction it
    # caught open would hold its row locks from every other worker for as long.
    link.sever()
    second, _ = worker(backend.url, spans, "--isolation", "process")
    processes.append(second)
    wait_until(lambda: completed_count(engine) == count, 60, "the second worker to finish the rest")
    assert first.poll() is None, "the cut-off worker lives on"
    assert_never_twice_at_once(spans, deaths)


@pytest.mark.backends("sqlite")  # about the worker's own process, not the database
def test_a_worker_whose_watchdog_is_killed_stops(
    default_queue: tq.TaskQueue, engine: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    worker = tq.Worker(default_queue, concurrency=1, poll_interval=0.05, shutdown_timeout=30)
    runner = threading.Thread(target=worker.run)
    with caplog.at_level(logging.ERROR, logger="sa_taskqueue"):
        runner.start()
        try:
            wait_until(lambda: worker._watchdog is not None, 30, "the watchdog to start")
            watchdog = worker._watchdog
            assert watchdog is not None
            os.kill(watchdog.pid, signal.SIGKILL)
            # The next task's claim tells the watchdog its deadline, and finds it gone.
            enqueue_one(default_queue, engine, "record", {"key": 1})
            runner.join(60)
        finally:
            worker.stop()
            runner.join(60)
    assert not runner.is_alive(), "the worker stopped by itself"
    assert "the watchdog process is gone" in caplog.text


@pytest.mark.backends("sqlite")  # about the worker's own process, not the database
def test_a_worker_idle_after_its_tasks_outlives_their_leases(
    backend: Backend,
    engine: sa.Engine,
    default_queue: tq.TaskQueue,
    spans: Path,
    deaths: Deaths,
    processes: list[subprocess.Popen[str]],
) -> None:
    # A busy worker leaves the watchdog's deadline in place when its tasks
    # finish, and its heartbeat clears it: were it left, the watchdog would
    # kill the idle worker one lease after the last claim.
    first_id = enqueue_one(default_queue, engine, "span", {"key": 1, "seconds": 0.01})
    first, _ = worker(backend.url, spans)
    processes.append(first)
    deaths.watch(first.pid)
    wait_until(lambda: completed(engine, first_id), 60, "the worker to complete the first task")
    # The watchdog's clock is the real one, in a process of its own: the
    # worker is watched through two leases of real time before the next task.
    idle_until = time.monotonic() + 2 * LEASE
    while time.monotonic() < idle_until:
        assert first.poll() is None, "the idle worker was left alive"
        time.sleep(0.05)
    second_id = enqueue_one(default_queue, engine, "span", {"key": 2, "seconds": 0.01})
    wait_until(lambda: completed(engine, second_id), 60, "the same worker to complete the next task")
    assert {run.pid for run in runs(spans)} == {first.pid}


ARMED_TWICE = """
import sys, time
from sa_taskqueue.worker.watchdog import Watchdog

watchdog = Watchdog(lambda error: None)
now = time.monotonic()
first, second, slack = (float(arg) for arg in sys.argv[1:])
watchdog.arm(now + first)
watchdog.arm(now + second, unless_sooner_than=slack)
print("armed", flush=True)
time.sleep(120)
"""


@pytest.mark.backends("sqlite")  # about the watchdog's process, not the database
@pytest.mark.parametrize(
    ("first", "second", "why"),
    [
        (2.0, 600.0, "a kill moving later is held back while the one armed is more than the slack away"),
        (600.0, 0.5, "a kill moving sooner is sent at once"),
    ],
)
def test_a_watchdog_armed_twice_kills_by_the_sooner_deadline(first: float, second: float, why: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", ARMED_TWICE, str(first), str(second), "1.0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "armed\n"
        assert process.wait(60) == -signal.SIGKILL, why
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(30)


WATCHDOG_IMPORTS = """
import sys
before = set(sys.modules)
path = sys.argv[1]
with open(path) as source:
    exec(compile(source.read(), path, "exec"), {"__name__": "imported"})  # its module code, not its loop
loaded = set(sys.modules) - before
print(" ".join(name for name in ("subprocess", "threading", "sqlalchemy", "sa_taskqueue") if name in loaded))
"""


@pytest.mark.backends("sqlite")  # about the watchdog's process, not the database
def test_the_watchdog_process_starts_on_the_few_standard_modules_it_uses() -> None:
    # Every worker starts one, on cores the workers share: the worker's side
    # of the watchdog (subprocess, threading) and the library stay out of it,
    # and it runs as it is started, with no site-packages (-I -S).
    from sa_taskqueue.worker import watchdog_process

    loaded = subprocess.run(
        [sys.executable, "-I", "-S", "-c", WATCHDOG_IMPORTS, watchdog_process.__file__],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert loaded.stdout.strip() == ""
