"""When each process the soak knows of was first seen dead: the end of a run that wrote no end line.

A killed task writes no end line, so its run is taken to last until its
process is seen dead.  A thread polls ``/proc/<pid>/stat`` every
`POLL_INTERVAL`: gone, a zombie (state Z), or a pid now naming a process with
another start time all count as dead.  Workers are the soak's children; under
process isolation a task runs in a worker's child, which the soak cannot wait
for, so ``/proc`` it is.  The time recorded is the first poll that saw the
process dead, a little after the death: a run is never taken to end early.
"""

from __future__ import annotations

import threading
import time

from benchmarks.soak.events import process_start_time

#: How often every live process is looked at.
POLL_INTERVAL = 0.02


def is_dead(pid: int, born: int | None) -> bool:
    """Whether process ``pid`` (started at ``born``) is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            after_name = stat.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    if after_name[0] == b"Z":
        return True
    return born is not None and int(after_name[19]) != born


class DeathWatch:
    """A thread that records when each watched process is first seen dead."""

    def __init__(self) -> None:
        self._watched: dict[tuple[int, int | None], None] = {}
        self._dead: dict[tuple[int, int | None], float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="soak-death-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def watch(self, pid: int, born: int | None = None) -> None:
        """Watch process ``pid``; ``born`` (its start time) tells it from a later process given its pid."""
        if born is None:
            born = process_start_time(pid)
        key = (pid, born)
        with self._lock:
            if key not in self._dead:
                self._watched[key] = None
        if born is None:  # already gone when we first heard of it
            self._mark_dead(key, time.time())

    def died_at(self, pid: int, born: int | None) -> float | None:
        with self._lock:
            return self._dead.get((pid, born))

    def alive(self) -> int:
        """How many watched processes are not yet seen dead."""
        with self._lock:
            return len(self._watched)

    def _mark_dead(self, key: tuple[int, int | None], when: float) -> None:
        with self._lock:
            if self._watched.pop(key, 0) is None:
                self._dead[key] = when

    def _poll(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                keys = list(self._watched)
            for key in keys:
                if is_dead(*key):
                    self._mark_dead(key, time.time())
            self._stop.wait(POLL_INTERVAL)
