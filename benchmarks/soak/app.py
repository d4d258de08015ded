"""The application the soak's workers run: ``sa-taskqueue worker benchmarks.soak.app:queue``.

Its one task, ``soak``, sleeps for the time its params say and appends a
start and an end line to the execution log (see `benchmarks.soak.events`).
Where everything is comes from the environment the soak gives each worker:
``SA_TASKQUEUE_SOAK_URL``, ``SA_TASKQUEUE_SOAK_LEASE`` (seconds) and
``SA_TASKQUEUE_SOAK_LOG`` (the execution log's path).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

import sa_taskqueue as tq
from benchmarks.soak.environment import LEASE_ENV, LOG_ENV, URL_ENV
from benchmarks.soak.events import append, end_event, open_log, ready_event, start_event
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.worker.worker import Worker

#: The worker process; in a forked child (process isolation) os.getpid() differs.
WORKER_PID = os.getpid()

#: The claim the current thread runs, set by the worker's on_start hook in the
#: thread that then calls the task, or forks the child that does.
_claim = threading.local()


def note_claim(task: ClaimedTask) -> None:
    """on_start hook: a task's function is not told its own id and attempt, so the hook tells it."""
    _claim.id, _claim.attempt = task.id, task.attempts


class SoakQueue(tq.TaskQueue):
    """A queue whose workers say when they are ready, and call `note_claim` before each task.

    (The command line takes no hooks.)  The command line has connected by
    the time it calls `run_worker`.
    """

    def run_worker(self, **options: Any) -> Worker:
        append(_log, ready_event())
        return super().run_worker(**options, on_start=note_claim)


def _build() -> tuple[SoakQueue, int]:
    url = os.environ.get(URL_ENV)
    log_path = os.environ.get(LOG_ENV)
    if not url or not log_path:
        raise RuntimeError(f"the soak's workers need {URL_ENV} and {LOG_ENV} (python -m benchmarks soak)")
    lease = timedelta(seconds=float(os.environ.get(LEASE_ENV, "3")))
    return SoakQueue(sa.create_engine(url), lease=lease), open_log(log_path)


queue, _log = _build()


@queue.task(name="soak")
def soak(sleep: float) -> None:
    """Log the start, sleep ``sleep`` seconds, log the end."""
    run = os.urandom(6).hex()
    append(_log, start_event(getattr(_claim, "id", -1), getattr(_claim, "attempt", -1), run, WORKER_PID))
    time.sleep(sleep)
    append(_log, end_event(run))
