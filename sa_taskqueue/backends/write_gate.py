"""A gate before a database file's one write lock, where lease renewals go first.

SQLite lets one connection write at a time, and a transactional task holds
that lock for its whole run.  Writers waiting for it poll (the busy handler
sleeps up to 100 ms between tries), in no order, so with a few slots running
transactional tasks back to back the lock is almost never free when a
waiting renewal looks: a worker's lease renewals starve until its watchdog
kills it, although nothing is wrong with it.

The gate puts the long writers, transactional tasks, in a line of their own
before the lock, one at a time, woken by the kernel the moment the gate is
free (``flock`` on a file beside the database), and lets a lease renewal go
ahead of that line: a renewal announces itself on a second file, and a task
that finds a renewal announced steps back out of the gate until the
renewals are done.  A renewal then waits for at most the one transactional
task already inside, and for the short statements (claims, completions)
that never queue at the gate.

Only processes of this library on one machine see the gate: an
application's own writes to the file, or a database on a network file system
shared by several machines, still meet only SQLite's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from pathlib import Path

#: What the gate's files are called: the database's path, then these.
GATE_SUFFIX = "-sa_taskqueue-gate"
RENEWING_SUFFIX = "-sa_taskqueue-renewing"


class WriteGate:
    """The gate of one database file.  `Passage` objects are held across a write; each is one thread's."""

    def __init__(self, database: str | os.PathLike[str]) -> None:
        path = Path(database).absolute()
        self.gate_path = f"{path}{GATE_SUFFIX}"
        self.renewing_path = f"{path}{RENEWING_SUFFIX}"

    def writer(self) -> Passage:
        """A long write's passage (a transactional task): it yields to renewals before it enters."""
        return Passage(self, renewal=False)

    def renewal(self) -> Passage:
        """A lease renewal's passage: announced first, so that the writers waiting let it through."""
        return Passage(self, renewal=True)


class Passage:
    """One pass through the gate: `enter` (blocks) and `leave`; leaving also happens when the process dies.

    Each passage opens the files anew: ``flock`` locks belong to an open
    file, so two threads of one process exclude each other as two processes do.
    """

    def __init__(self, gate: WriteGate, *, renewal: bool) -> None:
        self._gate = gate
        self._renewal = renewal
        self._fds: list[int] = []

    def enter(self) -> None:
        """Wait until this write may take the database's lock.

        A gate that cannot be opened (a read-only directory) is no gate:
        the write goes on to SQLite's lock as it would without one.
        """
        try:
            gate = self._open(self._gate.gate_path)
            renewing = self._open(self._gate.renewing_path)
        except OSError:
            self.leave()
            return
        try:
            self._wait(gate, renewing)
        except BaseException:
            self.leave()
            raise

    def _wait(self, gate: int, renewing: int) -> None:
        if self._renewal:
            fcntl.flock(renewing, fcntl.LOCK_SH)  # announced: writers arriving from now on step back
            fcntl.flock(gate, fcntl.LOCK_EX)
            return
        while True:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(renewing, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # A renewal is announced: out of its way until every renewal is through.
                fcntl.flock(gate, fcntl.LOCK_UN)
                fcntl.flock(renewing, fcntl.LOCK_EX)
                fcntl.flock(renewing, fcntl.LOCK_UN)
                continue
            fcntl.flock(renewing, fcntl.LOCK_UN)
            return

    def leave(self) -> None:
        """Let the next write through (closing the files lets go of their locks)."""
        fds, self._fds = self._fds, []
        with _OPEN_LOCK:
            _OPEN.difference_update(fds)
        for fd in fds:
            os.close(fd)

    def __enter__(self) -> Passage:
        self.enter()
        return self

    def __exit__(self, *_: object) -> None:
        self.leave()

    def _open(self, path: str) -> int:
        with _OPEN_LOCK:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            _OPEN.add(fd)
        self._fds.append(fd)
        return fd


# A lock belongs to the open file, which a forked child shares: a task
# process forked while another thread is inside would hold the gate shut for
# as long as it runs.  So a child closes its copies at once (the parent's
# keep the locks), and a passage opens its files under this lock, so that no
# fork comes between an open and its being counted here.
_OPEN: set[int] = set()
_OPEN_LOCK = threading.Lock()


def _close_inherited() -> None:
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()  # (held, maybe, by a thread that does not exist in the child)
    for fd in _OPEN:
        with contextlib.suppress(OSError):
            os.close(fd)
    _OPEN.clear()


os.register_at_fork(after_in_child=_close_inherited)


__all__ = ["GATE_SUFFIX", "RENEWING_SUFFIX", "Passage", "WriteGate"]
