"""What the parts of a worker share: the slots of its claimed tasks, its stop signals and its counts.

The claim loop, slot runner, outcome writer and lease keeper each own their
own state; this is the one table they all read, under its lock: which tasks
the worker holds, from their claim until their outcome is written.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.current_task import TaskContext
from sa_taskqueue.worker.execution import ChildProcess, Outcome


@dataclass
class Slot:
    """A task in a slot, and the child process running it (process isolation)."""

    task: ClaimedTask
    child: ChildProcess | None = None
    coroutine: Future[Outcome] | None = None  # an async def task's run on its loop
    given_back: bool = False
    #: Claimed for a slot still writing its last success, not for a free one:
    #: a stop asked for before its thread takes it up gives it back unstarted.
    claimed_ahead: bool = False
    #: Its outcome is settled for the batching of successes: handed to it, or none to hand.
    #: (It counts there from its claim until then, so that the successes of a
    #: claimed batch wait for the tasks whose threads have not taken them up yet.)
    reported: bool = False
    writing: bool = False  # its outcome is in a statement on its way
    #: Its success was handed over to be written with others'; the slot is freed once it is.
    handed_off: bool = False
    finished: bool = False  # the run is over; only its outcome is being written
    completing: bool = False  # its outcome waits in, or is in, a batch being written
    started: float = field(default_factory=time.monotonic)
    #: When the claim or the last renewal of its lease was sent (monotonic):
    #: the lease ends no sooner than one lease after this.
    renewed_at: float = field(default_factory=time.monotonic)
    lease_lost: bool = False  # no longer ours: another worker may run it
    thread: threading.Thread | None = None  # the slot thread that took it up
    #: Which of the worker's claims brought it (they count up from 1).
    claim: int = 0
    #: The run's wall time and its exception, once over: what its outcome's event carries.
    duration: float | None = None
    error: BaseException | None = None
    #: What `current_task` returns inside the run.
    context: TaskContext | None = None
    #: Someone cancelled the task while it ran, and the worker is stopping it.
    cancel_requested: bool = False
    #: When a cancelled task process is killed if it has not ended (monotonic).
    cancel_kill_at: float | None = None
    # Shutdown (giving back) and the task's thread (starting a child) decide
    # under this lock, so a task is never given back and then started.
    lock: threading.Lock = field(default_factory=threading.Lock)


class WorkerState:
    """The slots a worker holds (by ``id()``, from claim until the outcome is written) and its signals.

    ``stopping``: no more claims.  ``stopped``: `Worker.run` is returning;
    the background threads end.  ``wake``: the claim loop should look again.
    The counts are the worker's public ``processed``, ``failed``, ``given_back``
    and ``abandoned``.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.lock = threading.Lock()
        self.running: dict[int, Slot] = {}
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.wake = threading.Event()
        self.processed = 0
        self.failed = 0
        self.given_back = 0
        self.abandoned = 0

    def running_slots(self) -> list[Slot]:
        """The slots whose run is not over (not those only writing their outcome)."""
        with self.lock:
            return [slot for slot in self.running.values() if not slot.finished]

    def counts(self) -> dict[str, int]:
        return {"processed": self.processed, "failed": self.failed, "given_back": self.given_back}


def ids(task: ClaimedTask) -> tuple[int, str]:
    return task.id, task.name


__all__ = ["Slot", "WorkerState", "ids"]
