"""The watchdog process: what runs in the interpreter `sa_taskqueue.worker.watchdog.Watchdog` starts.

It reads one line per message from a pipe on its stdin:

``deadline <t>``  kill unless told otherwise before monotonic time ``t``
``disarm``        no task is running: nothing to enforce
``child <pid>``   a task process to kill along with the worker
``gone <pid>``    that task process has ended
``exit``          the worker is stopping cleanly

If the pipe closes without ``exit`` the worker died; the watchdog then kills
the task processes it knows of and exits.

Every worker starts one, so it imports no more than it uses: a few modules
of the standard library, with no ``site`` (``-I -S``) to read site-packages'
``.pth`` files.  Started from the module that also holds the worker's side
(`subprocess`, `threading`), it took about 24 ms of CPU to start and stop;
this way about 14, on a machine whose cores the workers, and every worker's
watchdog, share.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # (gone already)
        os.kill(pid, signal.SIGKILL)


def _watch(worker_pid: int) -> int:
    """Read the worker's messages until it exits, or kill it when its deadline passes."""
    stdin = sys.stdin.fileno()
    deadline: float | None = None
    children: set[int] = set()
    pending = b""
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            for child in children:
                _kill(child)
            _kill(worker_pid)
            print(
                f"sa_taskqueue watchdog: worker {worker_pid} did not renew its leases in time "
                f"(blocked, stopped or cut off from the database); killed it and "
                f"{len(children)} task process(es) before their leases end",
                file=sys.stderr,
            )
            return 1
        # Wake at the deadline, and now and then to notice a worker that died
        # while a forked grandchild still held the pipe open.
        timeout = 1.0 if deadline is None else min(1.0, max(deadline - now, 0.0))
        readable, _, _ = select.select([stdin], [], [], timeout)
        if not readable:
            if os.getppid() != worker_pid:
                break  # the worker is gone
            continue
        chunk = os.read(stdin, 65536)
        if not chunk:
            break  # the pipe closed without "exit": the worker died
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            word, _, argument = raw.decode().partition(" ")
            if word == "deadline":
                deadline = float(argument)
            elif word == "disarm":
                deadline = None
            elif word == "child":
                children.add(int(argument))
            elif word == "gone":
                children.discard(int(argument))
            elif word == "exit":
                return 0
    # The worker died: its task processes must not outlive it.
    for child in children:
        _kill(child)
    return 0


if __name__ == "__main__":
    # Ctrl+C in the worker's terminal is the worker's to handle; the watchdog
    # leaves only when told to, or when the worker is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(_watch(int(sys.argv[1])))
