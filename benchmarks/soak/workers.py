"""The soak's worker processes: real ``python -m sa_taskqueue worker`` processes, restarted when they die.

Each starts in a session of its own, so that a signal meant for one worker
and its task children (SIGSTOP, the final SIGKILL) reaches that process group
and nothing else.  Their logs go to a file per worker in the run's directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from benchmarks.soak.environment import LEASE_ENV, LOG_ENV, URL_ENV

ROOT = Path(__file__).resolve().parent.parent.parent
APP = "benchmarks.soak.app:queue"

#: How long a worker gets to finish its tasks once the soak is over.
SHUTDOWN_TIMEOUT = 5.0


@dataclass
class WorkerProcess:
    """One slot of the pool and the process currently filling it."""

    slot: int
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    starts: int = 1

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class WorkerPool:
    """``count`` workers of ``concurrency`` slots each, on one database, logging runs to one file."""

    count: int
    concurrency: int
    isolation: str
    url: str
    lease: float
    execution_log: Path
    directory: Path
    workers: list[WorkerProcess] = field(default_factory=list)
    #: Exits the soak did not cause, such as a worker that could not reach the
    #: database as it started (it says so and exits 1, as designed).
    unexpected_exits: list[str] = field(default_factory=list)
    #: Workers that did not stop within their shutdown time.
    hung: list[str] = field(default_factory=list)
    _killed: set[int] = field(default_factory=set)

    def start(self) -> None:
        self.workers = [self._spawn(slot) for slot in range(self.count)]

    def _spawn(self, slot: int) -> WorkerProcess:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            URL_ENV: self.url,
            LEASE_ENV: str(self.lease),
            LOG_ENV: str(self.execution_log),
        }
        command = [
            sys.executable,
            "-m",
            "sa_taskqueue",
            "worker",
            APP,
            "--concurrency",
            str(self.concurrency),
            "--isolation",
            self.isolation,
            "--poll-interval",
            "0.5",
            "--shutdown-timeout",
            str(SHUTDOWN_TIMEOUT),
            "--log-level",
            "warning",
        ]
        log = (self.directory / f"worker-{slot}.log").open("ab")
        process = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return WorkerProcess(slot, process, log)

    def pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    def kill(self, pid: int) -> None:
        """SIGKILL the worker process ``pid`` alone (its task children die with it, by their own guard)."""
        self._killed.add(pid)
        os.kill(pid, signal.SIGKILL)

    def signal_group(self, pid: int, signum: signal.Signals) -> None:
        """Send ``signum`` to the worker ``pid`` and its task children (its process group)."""
        os.killpg(pid, signum)

    def restart_exited(self) -> list[WorkerProcess]:
        """Start a new worker in the slot of each that has exited; return the new ones."""
        started = []
        for index, worker in enumerate(self.workers):
            code = worker.process.poll()
            if code is None:
                continue
            if worker.pid not in self._killed:
                self.unexpected_exits.append(f"worker {worker.pid} exited with code {code}")
            worker.log.close()
            fresh = self._spawn(worker.slot)
            fresh.starts = worker.starts + 1
            self.workers[index] = fresh
            started.append(fresh)
        return started

    def restarts(self) -> int:
        return sum(worker.starts - 1 for worker in self.workers)

    def stop(self) -> None:
        """SIGTERM every worker, give it its shutdown time, then SIGKILL its whole process group.

        The group is signalled only while its leader is not yet reaped, so
        that its id cannot have passed to a process the soak did not start.
        """
        for worker in self.workers:
            if worker.process.returncode is None:
                for signum in (signal.SIGCONT, signal.SIGTERM):
                    os.killpg(worker.pid, signum)
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT + 10
        for worker in self.workers:
            if worker.process.returncode is None:
                while not exited(worker.pid) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not exited(worker.pid):
                    self.hung.append(f"worker {worker.pid} did not stop on SIGTERM")
                os.killpg(worker.pid, signal.SIGKILL)  # its task children too, whatever became of it
            code = worker.process.wait()
            # -SIGTERM: a worker still starting, before it handles the signal.
            if code not in (0, -signal.SIGTERM) and worker.pid not in self._killed:
                self.unexpected_exits.append(f"worker {worker.pid} exited with code {code} on SIGTERM")
            worker.log.close()


def exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
