"""The worker: claim, run, record, renew leases, shut down cleanly.  No SQL of its own.

One loop claims as many tasks as there are free slots in a single claim and
hands each to a slot: a thread, or (``isolation="process"``) a thread that
supervises a forked child running the task.  A heartbeat thread renews the
leases of running tasks every third of the lease, on connections of its own.
On PostgreSQL an idle worker sleeps on LISTEN and is woken by the NOTIFY an
enqueue sends at commit; elsewhere it polls, backing off from a short
interval after work to ``poll_interval`` when idle.

An ``async def`` task runs on an event loop while its slot's thread waits
for it: the loop of the queue's async engine (so the task can use the
application's async engine and sessions), the loop given as ``event_loop``
(``run_worker_async`` passes the application's), or else one loop of the
worker's own, started with the first such task and stopped with the worker.

`Worker` is the coordinator; its parts each own their state: the claim loop
(`sa_taskqueue.worker.claim_loop`), the slot runner (`slot_runner`), the
outcome writer (`outcome_writer`), the lease keeper (`lease_keeper`) and the
service runner (`services`).  What it does is told on ``queue.events``:
its task log lines and hooks are subscribers there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.core.notify import can_listen
from sa_taskqueue.core.redaction import Redactor
from sa_taskqueue.core.services import Service
from sa_taskqueue.features.live_workers import heartbeat_of
from sa_taskqueue.features.pausing import PauseWatch
from sa_taskqueue.features.retention import RetentionService
from sa_taskqueue.features.schedules import ScheduleService
from sa_taskqueue.features.transactional import check_no_transactional
from sa_taskqueue.worker.cancelling import DEFAULT_CANCEL_GRACE, Canceller
from sa_taskqueue.worker.claim_loop import MAX_ERROR_BACKOFF, MIN_POLL_INTERVAL, ClaimLoop
from sa_taskqueue.worker.lease_keeper import LeaseKeeper, heartbeat_interval
from sa_taskqueue.worker.lifecycle import Emitter, subscribe_hooks, subscribe_log
from sa_taskqueue.worker.outages import Outages
from sa_taskqueue.worker.outcome_writer import OutcomeWriter
from sa_taskqueue.worker.pool_capacity import check_pool
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.progress import ProgressWriter
from sa_taskqueue.worker.services import ListenService, ServiceRunner
from sa_taskqueue.worker.slot_runner import Isolation, SlotRunner
from sa_taskqueue.worker.slot_threads import SlotThreads
from sa_taskqueue.worker.slots import Slot, WorkerState
from sa_taskqueue.worker.watchdog import Watchdog

logger = logging.getLogger("sa_taskqueue")

#: How long a stopping worker waits, at least, for the successes still to be written.
CLOSE_TIMEOUT = 10.0
#: How long a success waits, at most, for the other tasks the worker has
#: claimed, so that their successes are written in the same statement (seconds).
#: A millisecond gathers a claimed batch of quick tasks into one statement;
#: a longer wait gathers little more, and keeps the slots of tasks that run
#: a few milliseconds each from their next task (see the claiming page's
#: "Completions in batches" for both, measured).
DEFAULT_COMPLETION_DELAY = 0.001

StartHook = Callable[[ClaimedTask], None]
SuccessHook = Callable[[ClaimedTask, Any], None]
FailureHook = Callable[[ClaimedTask, BaseException], None]


class Worker:
    """Runs a queue's registered tasks until stopped.

    ``concurrency`` tasks run at once.  With ``burst`` the worker returns once
    nothing is due and nothing runs.  SIGTERM or SIGINT (when run in the main
    thread) stops claiming, lets running tasks finish for ``shutdown_timeout``
    seconds, then gives back what still runs (queued again, the attempt not
    counted); a second signal exits at once and leaves the rest to the leases.
    A thread cannot be stopped: under thread isolation a task given back
    still runs in its thread when `run` returns (``abandoned`` counts them),
    so the process should exit then, as the command line does.
    ``on_start``, ``on_success`` and ``on_failure`` are called around each
    task, for metrics or error reporting; an exception in a hook is logged and
    ignored.  ``on_success`` is called, in the task's thread, once its success
    is written; without it, a task's thread is free at once while its success
    waits to be written with others' (the slot is freed once it is written).
    ``on_failure`` and a task's failure likewise.

    The worker claims only tasks whose names it has registered: a task of a
    newer release stays queued for the workers that know it.  While it runs
    it is listed among the live workers (`TaskQueue.workers`), and it logs
    the due tasks no live worker serves (`sa_taskqueue.features.live_workers`).

    ``completion_delay`` (seconds) is how long a success may wait for the
    other tasks claimed and not finished, so that they are completed in one
    statement (`sa_taskqueue.worker.completions`); it never waits once none is left.
    Failures wait likewise, and go in a statement of their own.  0 writes
    each batch as soon as no write is under way.  Either way a slot is
    freed, for another claim, only once its outcome is written.  Where the
    worker claims ahead (PostgreSQL), slots freed while tasks of their own
    claim, or of a later one, still run wait as long for them, then claim
    together.

    With ``watchdog`` (the default) a process of its own (`sa_taskqueue.worker.watchdog`)
    kills this process and its task processes if the leases of running tasks
    are about to end unrenewed: a task holding the GIL, a SIGSTOP, a network
    partition.  So no task runs here after another worker may have claimed
    it.  Turn it off only where killing the process is worse than a task
    running twice at once (an embedded worker in an interactive session).
    Under process isolation a task whose lease cannot be renewed in time is
    stopped by the worker itself, which then lives on.

    ``cancel_grace`` is how long a cancelled task process has to stop (it
    gets SIGUSR1, `CancellationRequested` in the task) before it is killed
    (`sa_taskqueue.worker.cancelling`).

    ``event_loop`` is where ``async def`` tasks run under thread isolation:
    by default the loop of the queue's async engine, or, for a sync engine,
    one loop of the worker's own.  Under process isolation each runs on a
    loop of its child's own.
    """

    def __init__(
        self,
        queue: WorkerQueue,
        *,
        concurrency: int = 1,
        queues: Sequence[str] | None = None,
        burst: bool = False,
        poll_interval: float = 1.0,
        isolation: Isolation = "thread",
        shutdown_timeout: float = 30.0,
        worker_id: str | None = None,
        listen: bool = True,
        on_start: StartHook | None = None,
        on_success: SuccessHook | None = None,
        on_failure: FailureHook | None = None,
        watchdog: bool = True,
        event_loop: asyncio.AbstractEventLoop | None = None,
        self_test: bool = True,
        completion_delay: float = DEFAULT_COMPLETION_DELAY,
        cancel_grace: float = DEFAULT_CANCEL_GRACE,
    ) -> None:
        if not isinstance(concurrency, int) or isinstance(concurrency, bool) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        if isolation not in ("thread", "process"):
            raise ValueError(f"isolation must be 'thread' or 'process', got {isolation!r}")
        if isinstance(completion_delay, bool) or not (
            isinstance(completion_delay, int | float) and 0 <= completion_delay < math.inf
        ):
            raise ValueError(f"completion_delay must be a number of seconds >= 0, got {completion_delay!r}")
        if isinstance(cancel_grace, bool) or not (
            isinstance(cancel_grace, int | float) and cancel_grace >= 0
        ):
            raise ValueError(f"cancel_grace must be a number of seconds >= 0, got {cancel_grace!r}")
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must not be negative, got {shutdown_timeout!r}")
        if isinstance(queues, str):
            raise TypeError("queues must be a sequence of queue names, not a single string")
        self.queue = queue
        self.concurrency = concurrency
        self.queues = list(queues) if queues is not None else None
        self.burst = burst
        self.poll_interval = poll_interval
        self.isolation: Isolation = isolation
        self.shutdown_timeout = shutdown_timeout
        self.worker_id = worker_id or queue.default_worker_id()
        self.listen = listen
        self.on_start = on_start
        self.on_success = on_success
        self.on_failure = on_failure
        self.watchdog = watchdog
        self.self_test = self_test
        self.completion_delay = completion_delay
        self._listening = listen and not burst  # (unless the pool cannot spare a connection: see `run`)
        self._state = state = WorkerState(self.worker_id)
        self._emit = emit = Emitter(queue.events, state, queue.clock)
        self._outages = Outages(queue.engine.dialect, emit)
        self._lease = LeaseKeeper(queue, state, self._outages, emit)
        self._claims = ClaimLoop(
            queue,
            state,
            self._lease,
            self._outages,
            emit,
            concurrency=concurrency,
            queues=self.queues,
            burst=burst,
            poll_interval=poll_interval,
            completion_delay=completion_delay,
        )
        self._writer = OutcomeWriter(
            queue, state, self._claims, self._outages, emit, completion_delay=completion_delay
        )
        self._runner = SlotRunner(
            queue,
            state,
            self._claims,
            self._writer,
            self._lease,
            emit,
            isolation=isolation,
            event_loop=event_loop,
            hooked=self._hooked,
        )
        self._claims.bind(self._writer.completions, self._runner.give_back_unstarted)
        # Cancels of running tasks, and the progress they report (`worker.cancelling`, `worker.progress`).
        self._canceller = Canceller(queue, state, cancel_grace)
        self._lease.cancels = self._canceller.check
        self._progress = ProgressWriter(queue)
        self._runner.progress_sink = self._progress.report
        self._runner.forget_progress = self._progress.forget

    # The counts, kept where the parts count them ----------------------------

    @property
    def processed(self) -> int:
        """Tasks that succeeded since the worker was made."""
        return self._state.processed

    @processed.setter
    def processed(self, value: int) -> None:
        self._state.processed = value

    @property
    def failed(self) -> int:
        """Tasks that failed (retried or for good) since the worker was made."""
        return self._state.failed

    @failed.setter
    def failed(self, value: int) -> None:
        self._state.failed = value

    @property
    def given_back(self) -> int:
        """Tasks given back unstarted or unfinished, queued again with their attempt not counted."""
        return self._state.given_back

    @given_back.setter
    def given_back(self, value: int) -> None:
        self._state.given_back = value

    @property
    def abandoned(self) -> int:
        """Tasks still running in threads when the worker returned (given back or not)."""
        return self._state.abandoned

    @abandoned.setter
    def abandoned(self, value: int) -> None:
        self._state.abandoned = value

    @property
    def _running(self) -> dict[int, Slot]:
        """The slots held, by ``id()``: from each task's claim until its outcome is written."""
        return self._state.running

    @property
    def _watchdog(self) -> Watchdog | None:
        """The watchdog process guarding this run's leases, while it runs."""
        return self._lease.watchdog

    # Control ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; `run` returns once running tasks finish or are given back."""
        self._state.stopping.set()
        self._state.wake.set()

    @property
    def running_tasks(self) -> list[ClaimedTask]:
        """Tasks claimed and not finished: running, or claimed ahead and waiting for a slot.

        (Not those only writing their outcome.)
        """
        return [slot.task for slot in self._state.running_slots()]

    def _hooked(self, failed: bool) -> bool:
        """Whether a hook waits for this outcome's write (on the task's thread)."""
        return (self.on_failure if failed else self.on_success) is not None

    def run(self) -> None:
        """Run until stopped (or, with ``burst``, until nothing is due).

        With ``self_test`` (the default) the worker first proves its footing
        (`sa_taskqueue.health.self_test`) and raises `FootingError` instead of
        starting where the database, or a pooler in front of it, would let
        its claims overlap or its LISTEN go deaf.
        """
        state = self._state
        if self.isolation == "process":
            check_no_transactional(self.queue)
        if self.self_test and not self._prove_footing():
            return
        # (After the self-test, which waits out an outage: the strategy is known by now.)
        self._listening = check_pool(self.queue, self.concurrency, listen=self.listen and not self.burst)
        self._lease.read_lease()
        if self.watchdog:
            self._lease.start_watchdog(self._watchdog_lost)
        restore_signals = self._install_signal_handlers()
        heartbeat = threading.Thread(target=self._lease.heartbeat, name="sa_taskqueue-heartbeat", daemon=True)
        services = self._services()
        # The log lines first: a hook's own lines follow the task's.
        unsubscribe = [subscribe_log(self.queue.events, state, Redactor(self.queue.engine.url))]
        unsubscribe += subscribe_hooks(
            self.queue.events, state, self.on_start, self.on_success, self.on_failure
        )
        logger.info(
            "worker %s started: strategy=%s concurrency=%d isolation=%s queues=%s",
            self.worker_id,
            self.queue.strategy.name,
            self.concurrency,
            self.isolation,
            ",".join(self.queues) if self.queues is not None else "*",
        )
        self._live.begin()  # listed before its first claim, its start-up statements over by then
        self._emit.worker(EventKind.WORKER_STARTED)
        heartbeat.start()
        service_runner = ServiceRunner(self._emit)
        service_runner.start(services)
        pool = SlotThreads(
            self.concurrency, self._runner.take_up, self._runner.never_taken_up, name="sa_taskqueue-task"
        )
        self._writer.completions.start()
        self._progress.start()
        try:
            try:
                self._claims.run(pool)
            finally:
                self._runner.drain(self.shutdown_timeout)
        finally:
            self._lease.arm(exact=True)  # (slots that finished may have held a disarm back)
            # Writes the successes still waiting: those of slots left when the
            # shutdown timeout ran out, their runs over (see drain); through
            # an outage too, until the close times out and stopped is set.
            self._writer.completions.close(timeout=max(self.shutdown_timeout, CLOSE_TIMEOUT))
            state.stopped.set()
            service_runner.interrupt()  # (the listener's, rather than within its wait for a quiet second)
            with state.lock:
                self._lease.arm_locked(exact=True)  # the heartbeat, which would, has stopped
                # Threads still busy: given back and running on, stuck writing,
                # or the lone slot's, still waiting for its claim.
                state.abandoned = len(state.running) + self._claims.slot_claiming
            # Threads of tasks given back may still run; nothing waits for them.
            pool.shutdown()
            service_runner.stop(timeout=2)
            heartbeat.join(timeout=2)
            self._progress.stop()
            self._lease.close_watchdog()
            self._runner.stop_own_loop()
            restore_signals()
            logger.info(
                "worker %s stopped: %d done, %d failed, %d given back",
                self.worker_id,
                self.processed,
                self.failed,
                self.given_back,
            )
            self._emit.worker(EventKind.WORKER_STOPPED)
            for each in unsubscribe:
                each()

    def _services(self) -> list[Service]:
        """The background services this run starts beside the claim loop."""
        # The paused queues, kept fresh off the claim path: no claim waits for their read.
        services: list[Service] = [PauseWatch(self.queue.paused)]
        # Its row in the live-worker table, kept while it runs; and what no live worker serves, said.
        # (An outage it meets is the claim loop's to report: a heartbeat waiting out SQLite's
        # write lock behind a transactional task is no outage.)
        self._live = self.queue.live_workers.service(
            self.worker_id,
            queues=self.queues,
            task_names=self.queue.task_names,
            concurrency=self.concurrency,
            heartbeat=heartbeat_of(self._lease.heartbeat_seconds),
        )
        services.append(self._live)
        interval = self.queue.retention_interval
        if self.queue.retention and interval is not None and not self.burst:
            services.append(
                RetentionService(
                    self.queue.delete_expired,
                    interval,
                    self.worker_id,
                    self._state.stopping,
                    self._outages.trouble,
                    queues=self.queues,  # a worker deletes in the queues it serves, and only there
                )
            )
        if self._listening and can_listen(self.queue.engine):
            services.append(
                ListenService(
                    self.queue, self._claims.notified, self._claims.pause_changed, self._canceller.notified
                )
            )
        if self.queue.periodic_tasks:
            services.append(ScheduleService(self.queue, self.poll_interval, self._state.wake.set))
        return services

    def _prove_footing(self) -> bool:
        """Run the self-test once it can reach the database; raise `FootingError` if it fails.

        An outage (a server not up yet, SQLite's write lock held by an
        application) is waited out as the claim loop waits one out.  False
        if the worker was stopped meanwhile.
        """
        backoff = 0.0
        while not self._state.stopping.is_set():
            try:
                report = self.queue.check_footing(listen=self.listen and not self.burst)
            except DatabaseUnavailable as error:
                backoff = min(max(backoff * 2, 0.5), MAX_ERROR_BACKOFF)
                self._outages.trouble(error, backoff)
                self._state.stopping.wait(backoff)
                continue
            self._outages.back()
            for check in report.checks:
                logger.log(logging.DEBUG if check.passed else logging.ERROR, "self-test %s", check.line())
            if not report.ok:
                logger.error(
                    "worker %s refuses to start: the self-test failed (turn it off with self_test=False, "
                    "--no-self-test, only if you know better)",
                    self.worker_id,
                )
            report.raise_if_failed()
            return True
        return False

    def _watchdog_lost(self, error: OSError) -> None:
        logger.error(
            "the watchdog process is gone (%s): stopping, as nothing would stop a task whose lease ran out",
            error,
        )
        self.stop()

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            if self._state.stopping.is_set():
                logger.warning("received %s again: exiting now; leases will free the running tasks", name)
                with self._state.lock:
                    children = [slot.child for slot in self._state.running.values() if slot.child is not None]
                for child in children:
                    child.kill()  # no task may outlive its worker and run beside its next holder
                logging.shutdown()
                os._exit(1)
            logger.info(
                "received %s: claiming no more, giving running tasks %gs to finish",
                name,
                self.shutdown_timeout,
            )
            self.stop()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore


__all__ = [
    "CLOSE_TIMEOUT",
    "DEFAULT_COMPLETION_DELAY",
    "MAX_ERROR_BACKOFF",
    "MIN_POLL_INTERVAL",
    "Worker",
    "heartbeat_interval",
]
