"""The execution log: one line per start and per end of a task's run, appended by the task itself.

(And one line per worker once it is connected and about to claim.)

It is a file, not a table, so that what it says cannot be lost with the
task's transaction, nor with a connection or a server that the soak kills.
Each line is written by one ``os.write`` on an ``O_APPEND`` descriptor and is
far under 512 bytes, so lines from many processes never interleave.

A run is known by a token of its own: two runs of one task under one attempt
(which the queue should never allow) stay two runs here.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The longest line written; appends up to PIPE_BUF (512 bytes at least) are atomic.
MAX_LINE = 512


def open_log(path: str) -> int:
    """A descriptor that appends to ``path``; forked children inherit it and append through it too."""
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def append(fd: int, event: dict[str, Any]) -> None:
    """Write ``event`` as one line, in one system call."""
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    if len(line) > MAX_LINE:
        raise ValueError(f"an execution log line must stay under {MAX_LINE} bytes: {line!r}")
    os.write(fd, line)


def process_start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None once it is gone.

    Together with the pid it names one process: a pid the kernel hands out
    again belongs to a process with another start time.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[19])  # field 22 of stat(5); fields[0] here is field 3


def start_event(task_id: int, attempt: int, run: str, worker: int) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "event": "start",
        "run": run,
        "task": task_id,
        "attempt": attempt,
        "pid": pid,
        "born": process_start_time(pid),
        "worker": worker,
        "at": time.time(),
    }


def end_event(run: str) -> dict[str, Any]:
    return {"event": "end", "run": run, "at": time.time()}


def ready_event() -> dict[str, Any]:
    """A worker connected and about to claim: the soak adds its tasks once every worker is."""
    return {"event": "ready", "pid": os.getpid(), "at": time.time()}


@dataclass
class Execution:
    """One run of one task: where it ran, when it started, and when it ended or its process died."""

    run: str
    task: int
    attempt: int
    pid: int
    born: int | None
    worker: int
    started: float
    ended: float | None = None  # its end line
    died: float | None = None  # first seen dead without an end line

    @property
    def finished(self) -> float | None:
        """When the run stopped running: its end line, else when its process was first seen dead."""
        return self.ended if self.ended is not None else self.died


class ExecutionLog:
    """The executions read so far from one log file, read on as it grows.

    Only whole lines are read: a line being appended is left for the next read.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.executions: dict[str, Execution] = {}
        self.ready: set[int] = set()
        self._offset = 0
        self._pending_ends: dict[str, float] = {}

    def read_new(self) -> list[Execution]:
        """Read the lines appended since the last call; return the executions that started in them."""
        try:
            with self.path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except FileNotFoundError:
            return []
        complete = chunk.rfind(b"\n") + 1
        self._offset += complete
        started: list[Execution] = []
        for line in chunk[:complete].splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                execution = Execution(
                    run=event["run"],
                    task=event["task"],
                    attempt=event["attempt"],
                    pid=event["pid"],
                    born=event["born"],
                    worker=event["worker"],
                    started=event["at"],
                    ended=self._pending_ends.pop(event["run"], None),
                )
                self.executions[execution.run] = execution
                started.append(execution)
            elif event["event"] == "ready":
                self.ready.add(event["pid"])
            elif event["run"] in self.executions:
                self.executions[event["run"]].ended = event["at"]
            else:  # never expected: one process writes a run's start before its end
                self._pending_ends[event["run"]] = event["at"]
        return started

    def open_executions(self) -> list[Execution]:
        """Runs with neither an end line nor a dead process: running (or stopped) now."""
        return [e for e in self.executions.values() if e.ended is None and e.died is None]
