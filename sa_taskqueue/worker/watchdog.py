"""The watchdog: a small process that kills its worker before the worker's leases can end.

A lease promises that nobody else runs a task until it ends.  A worker keeps
that promise by renewing its leases, but a worker can be unable to renew and
still be alive: a task holding the GIL in a C call starves the heartbeat
thread, a SIGSTOP freezes the whole process, a network partition stalls every
statement.  The worker's process isolation children run on meanwhile.  So the
worker tells a process of its own, after each claim and each renewal, by when
it must have renewed again; if that moment passes, the watchdog SIGKILLs the
worker and every task process it registered, while their leases still hold.
A worker that cannot prove it is alive is dead before another may claim its
tasks.

The watchdog is a separate interpreter running `sa_taskqueue.worker.watchdog_process`
(started with ``-I -S``: the standard library only, so that nothing the worker
does can stall it), in a session of its own, so that a signal sent to the
worker's process group (a terminal's Ctrl+Z) does not stop it too.  That
module says what it reads from the pipe.

What no watchdog covers: a whole machine paused (a VM suspended) past the
lease, and wall clocks of different machines disagreeing by more than
`KILL_MARGIN`.  Monotonic time is shared by every process of one machine,
which is why deadlines are in it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from sa_taskqueue.worker import watchdog_process

#: The watchdog kills this long before a lease would end, or a quarter of the
#: lease when that is shorter: time for the kill to land, and for clocks.
KILL_MARGIN = 5.0


def kill_at(renewed_at: float, lease_seconds: float) -> float:
    """The monotonic time by which a lease taken at ``renewed_at`` must be renewed, or its worker killed."""
    return renewed_at + lease_seconds - min(KILL_MARGIN, lease_seconds / 4)


class Watchdog:
    """The worker's side: starts the watchdog process and sends it deadlines.

    Thread-safe: the claim loop, the heartbeat and task threads all report.
    """

    def __init__(self, on_lost: Callable[[OSError], None], worker_pid: int | None = None) -> None:
        """Start the watchdog process; ``on_lost`` is called once if it is ever found gone."""
        self.worker_pid = worker_pid or os.getpid()
        self._on_lost = on_lost
        self._lock = threading.Lock()
        read_end, self._write_end = os.pipe()
        # A watchdog that stopped reading must not block the worker: a full
        # pipe counts as a watchdog gone.
        os.set_blocking(self._write_end, False)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-u", watchdog_process.__file__, str(self.worker_pid)],
                stdin=read_end,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self._deadline: float | None = None
        self._closed = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def fileno(self) -> int:
        """The pipe's writing end: a forked task process registers itself through it."""
        return self._write_end

    def arm(self, deadline: float | None, *, unless_sooner_than: float | None = None) -> None:
        """Kill the worker at monotonic ``deadline`` unless armed again first; None disarms.

        Each change wakes the watchdog process, which a busy worker would do
        twice per claimed batch.  With ``unless_sooner_than`` (seconds), a
        change that only moves the kill later (or disarms) is held back while
        the deadline armed is further away than that: the caller promises to
        arm again, exactly, before then.  A deadline moving sooner is always
        sent at once.
        """
        with self._lock:
            if deadline == self._deadline:
                return
            later = self._deadline is not None and (deadline is None or deadline > self._deadline)
            if later and unless_sooner_than is not None:
                assert self._deadline is not None
                if self._deadline - time.monotonic() > unless_sooner_than:
                    return
            self._deadline = deadline
            self._send("disarm" if deadline is None else f"deadline {deadline!r}")

    def armed_beyond(self, seconds: float, *, not_after: float | None = None) -> bool:
        """Whether a kill is armed further than ``seconds`` away (and no later than ``not_after``).

        If so, `arm` with that much slack would send a kill sooner than the
        one armed only, and a deadline at ``not_after`` is not one.
        """
        with self._lock:
            deadline = self._deadline
            return (
                deadline is not None
                and deadline - time.monotonic() > seconds
                and (not_after is None or deadline <= not_after)
            )

    def gone(self, pid: int) -> None:
        """A task process has ended (call before it is reaped, so its pid is not reused meanwhile)."""
        with self._lock:
            self._send(f"gone {pid}")

    def close(self) -> None:
        """The worker stops cleanly: the watchdog exits without killing anything."""
        with self._lock:
            if self._closed:
                self._process.poll()
                return
            self._send("exit")
            self._closed = True
            os.close(self._write_end)
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, line: str) -> None:
        if self._closed:
            return
        try:
            os.write(self._write_end, f"{line}\n".encode())
        except OSError as error:  # the watchdog was killed: nothing guards the leases any more
            self._closed = True
            os.close(self._write_end)
            self._on_lost(error)


def register_child(fileno: int) -> None:
    """In a freshly forked task process: ask the watchdog to kill it along with the worker.

    The child then closes its copy of the pipe, so that the pipe still closes
    when the worker dies.
    """
    try:
        os.write(fileno, f"child {os.getpid()}\n".encode())
    finally:
        os.close(fileno)
