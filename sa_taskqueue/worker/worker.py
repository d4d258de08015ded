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
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.concurrency import LIMITED_RECHECK_SECONDS
from sa_taskqueue.core.error_text import error_message
from sa_taskqueue.core.event_loop_bridge import LoopThread
from sa_taskqueue.core.exceptions import DatabaseError, DatabaseUnavailable, MalformedTask, TaskNotRegistered
from sa_taskqueue.core.log_fields import task_fields
from sa_taskqueue.core.notify import Listener, can_listen
from sa_taskqueue.core.validation import check_result
from sa_taskqueue.features.schedules import run_ticker
from sa_taskqueue.features.transactional import AsyncRun, SyncRun, check_no_transactional, log_lease_lost
from sa_taskqueue.worker.completions import Completions
from sa_taskqueue.worker.execution import (
    CANCELLED_CLEANUP_WAIT,
    ChildProcess,
    GivenBack,
    Outcome,
    run_in_thread,
    run_on_loop,
)
from sa_taskqueue.worker.slot_threads import SlotThreads
from sa_taskqueue.worker.watchdog import Watchdog, kill_at, register_child

if TYPE_CHECKING:
    from sa_taskqueue.core.registered import RegisteredTask
    from sa_taskqueue.queue import TaskQueue

logger = logging.getLogger("sa_taskqueue")

#: Longest pause between claims after database errors.
MAX_ERROR_BACKOFF = 30.0
#: The first poll after a claim came back short; doubled up to ``poll_interval``.
MIN_POLL_INTERVAL = 0.05
#: How long a stopping worker waits, at least, for the successes still to be written.
CLOSE_TIMEOUT = 10.0
#: How long a success waits, at most, for the other tasks the worker has
#: claimed, so that their successes are written in the same statement (seconds).
#: A millisecond gathers a claimed batch of quick tasks into one statement;
#: a longer wait gathers little more, and keeps the slots of tasks that run
#: a few milliseconds each from their next task (see the README's
#: Performance section for both, measured).
DEFAULT_COMPLETION_DELAY = 0.001

T = TypeVar("T")
Isolation = Literal["thread", "process"]
StartHook = Callable[[ClaimedTask], None]
SuccessHook = Callable[[ClaimedTask, Any], None]
FailureHook = Callable[[ClaimedTask, BaseException], None]


@dataclass
class _Running:
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
    # Shutdown (giving back) and the task's thread (starting a child) decide
    # under this lock, so a task is never given back and then started.
    lock: threading.Lock = field(default_factory=threading.Lock)


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
    newer release stays queued for the workers that know it.

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

    ``event_loop`` is where ``async def`` tasks run under thread isolation:
    by default the loop of the queue's async engine, or, for a sync engine,
    one loop of the worker's own.  Under process isolation each runs on a
    loop of its child's own.
    """

    def __init__(
        self,
        queue: TaskQueue,
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
        self._watchdog: Watchdog | None = None
        self.processed = 0
        self.failed = 0
        self.given_back = 0
        #: Tasks still running in threads when the worker returned (given back or not).
        self.abandoned = 0
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._running: dict[int, _Running] = {}  # by id(): a slot until its outcome is written
        self._lock = threading.Lock()
        self.completion_delay = completion_delay
        self._completions = Completions(
            self._write_successes,
            self._record_success,
            delay=completion_delay,
            fail_many=self._write_failures,
            fail_one=self._record_failure,
            after_write=self._admit_claimed_with_write,
        )
        self._database_down = False
        #: Whether the loop claims during writes, and whether a lone slot claims
        #: its next task on its own thread (see `_claim_here`): set up by `_loop`,
        #: where the backend is known.
        self._claims_ahead = False
        self._claims_in_slot = False
        #: The lone slot, just freed, is claiming its next task itself: not free for the loop.
        self._slot_claiming = False
        #: Set by `_drain` once it has decided what to give back: a task the lone
        #: slot claims after that is given back unstarted.
        self._slots_closed = False
        #: The claims the loop has sent, and the oldest claim of the slots freed since the last one.
        self._claims_sent = 0
        self._oldest_freed: int | None = None
        #: Whether a write of successes claims the next tasks in the same
        #: commit (`_claim_with_write`): set up by `_loop`.
        self._claims_with_writes = False
        #: A claim is on its way: the loop's own, or one sent with a write of
        #: successes.  Neither is sent while the other is, so that no more
        #: tasks are claimed than there are slots for.
        self._loop_claiming = False
        self._write_claiming = False
        #: What a write of successes claimed, given to slots once the slots it frees are free.
        self._claimed_with_write: tuple[list[ClaimedTask], float, int, int] | None = None
        self._pool: SlotThreads[_Running] | None = None
        self._event_loop = event_loop
        self._own_loop: LoopThread | None = None
        self._lease_seconds = self._heartbeat_seconds = self._arm_slack = 0.0
        self._read_lease()

    def _read_lease(self) -> None:
        """Note the lease and heartbeat in seconds, and the slack a later kill may be held back within.

        Read as the worker is made and again as each run starts, rather than
        twice for every task (see `_arm_locked`).
        """
        self._lease_seconds = self.queue.lease.total_seconds()
        self._heartbeat_seconds = heartbeat_interval(self._lease_seconds)
        self._arm_slack = 2 * self._heartbeat_seconds

    # Control ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop claiming; `run` returns once running tasks finish or are given back."""
        self._stopping.set()
        self._wake.set()

    @property
    def running_tasks(self) -> list[ClaimedTask]:
        """Tasks claimed and not finished: running, or claimed ahead and waiting for a slot.

        (Not those only writing their outcome.)
        """
        return [slot.task for slot in self._running_slots()]

    def _running_slots(self) -> list[_Running]:
        with self._lock:
            return [slot for slot in self._running.values() if not slot.finished]

    def run(self) -> None:
        """Run until stopped (or, with ``burst``, until nothing is due).

        With ``self_test`` (the default) the worker first proves its footing
        (`sa_taskqueue.health.self_test`) and raises `FootingError` instead of
        starting where the database, or a pooler in front of it, would let
        its claims overlap or its LISTEN go deaf.
        """
        if self.isolation == "process":
            check_no_transactional(self.queue)
        if self.self_test and not self._prove_footing():
            return
        self._read_lease()
        if self.watchdog:
            self._watchdog = Watchdog(self._watchdog_lost)
        restore_signals = self._install_signal_handlers()
        background: list[threading.Thread] = [
            threading.Thread(target=self._heartbeat, name="sa_taskqueue-heartbeat", daemon=True)
        ]
        if self.queue.retention and not self.burst:
            background.append(
                threading.Thread(target=self._retention, name="sa_taskqueue-retention", daemon=True)
            )
        # Paused queues are read again at least once per poll interval.
        self.queue.paused.check_within(self.poll_interval)
        listener: Listener | None = None
        if self.listen and not self.burst and can_listen(self.queue.engine):
            listener = Listener(
                self.queue.engine, self.queue.table, self._notified, self._stopped, self._pause_changed
            )
            background.append(listener)
        if self.queue.periodic_tasks:
            # Periodic tasks are enqueued from a thread of their own: a tick never delays a claim.
            ticker = partial(run_ticker, self.queue, self._stopped, self.poll_interval, self._wake.set)
            background.append(threading.Thread(target=ticker, name="sa_taskqueue-schedules", daemon=True))
        logger.info(
            "worker %s started: strategy=%s concurrency=%d isolation=%s queues=%s",
            self.worker_id,
            self.queue.strategy.name,
            self.concurrency,
            self.isolation,
            ",".join(self.queues) if self.queues is not None else "*",
        )
        for thread in background:
            thread.start()
        pool = SlotThreads(self.concurrency, self._take_up, self._never_taken_up, name="sa_taskqueue-task")
        self._completions.start()
        try:
            try:
                self._loop(pool)
            finally:
                self._drain()
        finally:
            with self._lock:
                self._arm_locked(exact=True)  # (slots that finished may have held a disarm back)
            # Writes the successes still waiting: those of slots left when the
            # shutdown timeout ran out, their runs over (see _drain); through
            # an outage too, until the close times out and _stopped is set.
            self._completions.close(timeout=max(self.shutdown_timeout, CLOSE_TIMEOUT))
            self._stopped.set()
            if listener is not None:
                listener.interrupt()  # (rather than within its wait for a quiet second)
            with self._lock:
                self._arm_locked(exact=True)  # the heartbeat, which would, has stopped
                # Threads still busy: given back and running on, stuck writing,
                # or the lone slot's, still waiting for its claim.
                self.abandoned = len(self._running) + self._slot_claiming
            # Threads of tasks given back may still run; nothing waits for them.
            pool.shutdown()
            for thread in background:
                thread.join(timeout=2)
            if self._watchdog is not None:
                self._watchdog.close()
                self._watchdog = None
            if self._own_loop is not None:
                self._own_loop.stop()
                self._own_loop = None
            restore_signals()
            logger.info(
                "worker %s stopped: %d done, %d failed, %d given back",
                self.worker_id,
                self.processed,
                self.failed,
                self.given_back,
            )

    def _prove_footing(self) -> bool:
        """Run the self-test once it can reach the database; raise `FootingError` if it fails.

        An outage (a server not up yet, SQLite's write lock held by an
        application) is waited out as the claim loop waits one out.  False
        if the worker was stopped meanwhile.
        """
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                report = self.queue.check_footing(listen=self.listen and not self.burst)
            except DatabaseUnavailable as error:
                backoff = min(max(backoff * 2, 0.5), MAX_ERROR_BACKOFF)
                self._database_trouble(error, backoff)
                self._stopping.wait(backoff)
                continue
            self._database_back()
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

    # The claim loop ----------------------------------------------------------

    def _loop(self, pool: SlotThreads[_Running]) -> None:
        claim_ahead = self._claims_ahead = backend_for(self.queue.engine.dialect).claims_ahead
        # Where the database commits a completion and a claim at once, the
        # write of a batch's successes claims for the slots it frees; the
        # loop claims only for slots that free otherwise, and when idle.
        # (Not with limited tasks to claim: their claim is a transaction of its own.)
        self._claims_with_writes = self.queue.strategy.completes_and_claims_at_once(
            self.queue.engine.dialect
        ) and not any(
            registered.options.concurrency is not None
            for registered in map(self.queue.registered, self.queue.task_names)
            if registered is not None
        )
        # Else, with one slot and no claim sent during a write: the slot's
        # thread claims its next task itself once its outcome is written,
        # rather than wake this loop to claim it and hand it over, two
        # thread switches a task.
        self._claims_in_slot = self.concurrency == 1 and not claim_ahead and not self._claims_with_writes
        self._pool = pool
        self._slots_closed = False
        idle_delay = MIN_POLL_INTERVAL
        error_backoff = 0.0
        gathering_since: float | None = None  # (monotonic) some slots free, waiting for the rest
        while not self._stopping.is_set():
            batch_running = False
            with self._lock:
                # Slots whose outcome waits for, or is in, a batch being
                # written free up within a write from now.  (Not slots in
                # hooks, or writing an outcome alone: those may take long.)
                completing = any(slot.completing for slot in self._running.values())
                writing = sum(1 for slot in self._running.values() if slot.writing)
                free = self.concurrency - len(self._running) - self._slot_claiming
                free_now = free
                counted_at = self._claims_sent  # (a claim numbered since makes this count stale)
                if claim_ahead:
                    # Claim for them already, so that their next tasks are
                    # here when they free, the claim's round trip spent
                    # during the write's.  Those tasks wait in the pool for
                    # the slots, their leases running from the claim and
                    # renewed like any other.
                    free += writing
                    # (Read only where a claim would follow: with no slot free the loop just waits.)
                    batch_running = free > 0 and self._batch_still_running_locked()
                if self._write_claiming:
                    free = 0  # a write claims for every slot free or writing: it wakes this loop when done
            if free <= 0:
                gathering_since = None
                self._wait(None)
                continue
            if completing and not claim_ahead:
                # Claim for them once they free, in one claim with the rest.
                self._wait(self.poll_interval)
                continue
            if claim_ahead and batch_running:
                # Tasks of the same claim as the slots to claim for, or of a
                # later one, still run (or wait for their write): wait a
                # little for them to end too, so that their slots claim
                # together.  Claimed apart, the slots of a batch whose last
                # task ended late would go on claiming, and completing, in
                # two statements each round.  (Not for a task of an older
                # claim: a long task in one slot holds up no claim for the
                # others.)
                now = time.monotonic()
                if gathering_since is None:
                    gathering_since = now
                left = gathering_since + self.completion_delay - now
                if left > 0:
                    self._wait(left)
                    continue
            gathering_since = None
            self._wake.clear()
            with self._lock:
                if self._write_claiming or self._claims_sent != counted_at:
                    continue  # (a write claimed since the slots were counted: count them again)
                self._loop_claiming = True
                claim = self._next_claim_locked()
            sent_at = time.monotonic()
            try:
                claimed = self._claim(free)
            except DatabaseUnavailable as error:
                with self._lock:
                    self._loop_claiming = False
                error_backoff = min(max(error_backoff * 2, 0.5), MAX_ERROR_BACKOFF)
                self._database_trouble(error, error_backoff)
                self._stopping.wait(error_backoff)
                continue
            except BaseException:
                with self._lock:
                    self._loop_claiming = False
                raise
            error_backoff = 0.0
            self._database_back()
            self._admit(claimed, sent_at, claim, free_now)
            if len(claimed) == free:
                idle_delay = MIN_POLL_INTERVAL
                continue  # every slot taken: wait for one below, then claim again
            if not claimed and self.burst:
                with self._lock:
                    # (Nor a write's claim on its way: its tasks would be given back.)
                    idle = not self._running and not self._write_claiming
                if idle:
                    return
            if not claimed:
                with self._lock:
                    if not self._running:
                        # Idle: a disarm held back (see _arm_locked) is sent now.
                        self._arm_locked(exact=True)
            # A short claim: poll again soon, backing off while nothing comes.
            idle_delay = MIN_POLL_INTERVAL if claimed else min(idle_delay * 2, self.poll_interval)
            # Jitter below the delay, so that idle workers spread out and no
            # wait exceeds poll_interval.
            delay = idle_delay * random.uniform(0.8, 1.0)
            logger.debug("nothing more due: next poll in %.2fs", delay)
            self._wait(delay)

    def _batch_still_running_locked(self) -> bool:
        """Whether a task of a freed or writing slot's claim, or of a later claim, is yet to be written.

        (Under ``_lock``.)  Where slots claim ahead, those tasks' slots are
        the ones worth waiting for: still running, or their outcome waiting
        for a write, they free within a task's run and a write of the
        others.  Not a slot in a hook, its outcome written: it may take long.
        """
        oldest = self._oldest_freed
        for slot in self._running.values():
            if slot.writing and (oldest is None or slot.claim < oldest):
                oldest = slot.claim
        if oldest is None:
            return False
        return any(
            slot.claim >= oldest and not slot.writing and (not slot.finished or slot.completing)
            for slot in self._running.values()
        )

    def _claim(self, limit: int) -> list[ClaimedTask]:
        """Claim up to ``limit`` due tasks of this worker's queues and registered names."""
        return self.queue.claim(
            limit=limit,
            queues=self.queues,
            worker_id=self.worker_id,
            names=self.queue.task_names,
            limited_recheck=LIMITED_RECHECK_SECONDS,
        )

    def _next_claim_locked(self) -> int:
        """Number the claim about to be sent (under ``_lock``)."""
        self._claims_sent += 1
        self._oldest_freed = None  # (slots freed from now on are this claim's to wait for)
        return self._claims_sent

    def _admit(self, claimed: list[ClaimedTask], sent_at: float, claim: int, free_now: int) -> None:
        """Give the tasks of claim number ``claim`` to slots, and end that claim.

        The first ``free_now`` go to slots free at the claim; the rest were
        claimed ahead for slots still writing.  Their leases run from
        ``sent_at``, when the claim was sent.  Claimed once `_drain` has
        decided what to give back, they are given back unstarted.
        """
        slots = [
            _Running(task, renewed_at=sent_at, claimed_ahead=index >= free_now, claim=claim)
            for index, task in enumerate(claimed)
        ]
        with self._lock:
            self._loop_claiming = self._write_claiming = False
            closed = self._slots_closed
            if slots and not closed:
                # Armed before a task can start: their leases run from the claim.
                self._arm_locked(extra=slots[0])
                for slot in slots:
                    self._running[id(slot)] = slot
        if closed:
            for slot in slots:
                self._give_back_unstarted(slot)
            return
        if slots:
            # Each ended by its success, or by _no_success; all before any can end.
            self._completions.begin(len(slots))
        assert self._pool is not None  # (set by _loop before any claim)
        for slot in slots:
            self._pool.submit(slot)

    def _wait(self, timeout: float | None) -> None:
        """Sleep until a slot frees, a notification arrives, a stop is asked for, or ``timeout``."""
        self._wake.wait(timeout)
        self._wake.clear()

    def _take_up(self, slot: _Running) -> None:
        """A slot's thread takes up its task, and the lone slot's next ones as it claims them."""
        next_slot: _Running | None = slot
        while next_slot is not None:
            slot = next_slot
            slot.thread = threading.current_thread()
            try:
                self._execute(slot)
            except BaseException as error:  # noqa: BLE001 - the thread serves the next slot all the same
                logger.error("a task slot ended with an error: %r", error)
                if not slot.handed_off:  # (else its write frees it)
                    self._free(slot)
            next_slot = self._claim_here()

    def _claim_here(self) -> _Running | None:
        """The lone slot, freed on this thread by its own write, claims its next task here.

        None if it is not to (`_free` decides), or nothing was claimed: the
        loop claims again then, as it does for any free slot.  A task claimed
        once `_drain` has decided what to give back is given back unstarted.
        """
        with self._lock:
            # (Not once the main thread has ended either: the interpreter is
            # exiting, and this non-daemon thread must not keep it running.)
            if not self._slot_claiming or self._stopping.is_set() or not threading.main_thread().is_alive():
                self._hand_claims_back()
                return None
        sent_at = time.monotonic()
        try:
            claimed = self._claim(1)
        except DatabaseUnavailable as error:
            logger.debug("the slot's own claim failed (%s): the worker's loop claims again", error)
            claimed = []
        except Exception:
            logger.exception("the slot's own claim failed: the worker's loop claims again")
            claimed = []
        if not claimed:
            with self._lock:
                self._hand_claims_back()
            return None
        slot = _Running(claimed[0], renewed_at=sent_at)
        with self._lock:
            self._slot_claiming = False
            closed = self._slots_closed
            if not closed:
                self._arm_locked(extra=slot)  # before it can start: its lease runs from the claim
                self._running[id(slot)] = slot
        if closed:
            self._give_back_unstarted(slot)
            return None
        self._database_back()
        self._completions.begin(1)
        return slot

    def _hand_claims_back(self) -> None:
        """The loop claims for the lone slot again (under ``_lock``)."""
        if self._slot_claiming:
            self._slot_claiming = False
            self._wake.set()

    def _never_taken_up(self, slot: _Running) -> None:
        """No thread took the task up before the worker stopped."""
        self._no_success(slot)
        self._free(slot)

    def _free(self, slot: _Running) -> None:
        """The slot's task is done with, its outcome written: another may be claimed for it.

        Freed on its own thread, the lone slot claims its next task there
        (`_claim_here`); the loop, not woken, goes on waiting.
        """
        with self._lock:
            freed = self._running.pop(id(slot), None)
            if freed is not None and (self._oldest_freed is None or slot.claim < self._oldest_freed):
                self._oldest_freed = slot.claim
            claims_here = (
                freed is not None
                and self._claims_in_slot
                and slot.thread is threading.current_thread()
                and not self._running
                and not self._stopping.is_set()
            )
            if claims_here:
                self._slot_claiming = True
            self._arm_locked()
        if freed is None:
            return
        if slot.task.concurrency_key is not None:
            self.queue.recheck_limited()  # its key has a free slot now
        if not claims_here and not self._wake.is_set():
            self._wake.set()

    def _notified(self, queue_name: str) -> None:
        if not queue_name or self.queues is None or queue_name in self.queues:
            self.queue.recheck_limited()
            self._wake.set()

    def _pause_changed(self, _queue_name: str) -> None:
        # A queue was paused or resumed: read the paused queues again, and
        # claim now (a resumed queue may hold due tasks).
        self.queue.paused.invalidate()
        self._wake.set()

    def _drain(self) -> None:
        """Let running tasks finish within ``shutdown_timeout``, then give back the rest.

        A task whose run is over, its outcome still being written, is not
        given back: its success would then be refused, and it would run again.
        """
        deadline = time.monotonic() + self.shutdown_timeout
        while (self._running or self._slot_claiming) and time.monotonic() < deadline:
            self._wake.wait(min(0.1, max(deadline - time.monotonic(), 0)))
            self._wake.clear()
        with self._lock:
            self._slots_closed = True  # a claim the lone slot still waits for is given back
            # Decided under the lock _finished takes: a task is either given
            # back here or, finished first, has its outcome written.
            leftover = [slot for slot in self._running.values() if not slot.finished]
            for slot in leftover:
                with slot.lock:
                    slot.given_back = True
        self.abandoned = len(leftover)
        for slot in leftover:
            with slot.lock:
                if slot.child is not None:
                    slot.child.kill()
                if slot.coroutine is not None:
                    slot.coroutine.cancel()  # an async task stops at its next await
        self._await_cancelled([slot for slot in leftover if slot.coroutine is not None])
        for slot in leftover:
            try:
                released = self.queue.release(slot.task)
            except DatabaseUnavailable as error:
                logger.error(
                    "task %d %s: could not give it back (%s); its lease will", *_ids(slot.task), error
                )
                continue
            if released:
                self.given_back += 1
                logger.info(
                    "task %d %s attempt %d given back unfinished", *_ids(slot.task), slot.task.attempts
                )

    def _await_cancelled(self, slots: list[_Running]) -> None:
        """Wait, bounded, until cancelled async tasks have run their cleanup.

        A task given back while its coroutine still runs its ``finally`` or
        ``async with`` exit could be claimed and run by another worker
        meanwhile; its slot's thread returns once the coroutine has ended.
        """
        deadline = time.monotonic() + CANCELLED_CLEANUP_WAIT
        while time.monotonic() < deadline:
            with self._lock:
                if all(slot.finished for slot in slots):
                    return
            time.sleep(0.02)

    # One task -----------------------------------------------------------------

    def _execute(self, slot: _Running) -> None:
        """A slot's thread: run the task, record its outcome, free the slot (or leave that to the write)."""
        try:
            with slot.lock:
                given_back = slot.given_back
            if given_back:
                return  # given back by a shutdown before this thread took it up: not ours to start
            if (self._stopping.is_set() and slot.claimed_ahead) or slot.lease_lost:
                # Claimed ahead, and its slot came free only after a stop was
                # asked for, or its lease was lost: it does not start.  A task
                # claimed for a free slot starts, stop or not: it shows as
                # running from its claim, and shutdown_timeout bounds its run.
                self._no_success(slot)
                self._give_back_unstarted(slot)
                return
            self._run_task(slot)
        except Exception as error:
            logger.exception(
                "task %d %s: the worker could not run it",
                *_ids(slot.task),
                extra=task_fields(slot.task, self.worker_id, error=error_message(error)),
            )
            if not slot.handed_off:
                self._finished(slot)
                self._no_success(slot)
                self._record(slot.task, Outcome(error=error))
        finally:
            if not slot.handed_off:
                self._no_success(slot)
                self._free(slot)

    def _no_success(self, slot: _Running) -> None:
        """The task has no success for the batch to wait for (once per task claimed)."""
        if not slot.reported:
            slot.reported = True
            self._completions.end_without_success()

    def _give_back_unstarted(self, slot: _Running) -> None:
        """Give a task that never started back to the queue at once, rather than to its lease."""
        with slot.lock:
            slot.given_back = True
        if slot.lease_lost:
            return  # another worker may hold it by now: nothing of it is ours to write
        try:
            released = self.queue.release(slot.task)
        except DatabaseUnavailable as error:
            logger.error("task %d %s: could not give it back (%s); its lease will", *_ids(slot.task), error)
            return
        if released:
            with self._lock:
                self.given_back += 1
            logger.info("task %d %s attempt %d given back unstarted", *_ids(slot.task), slot.task.attempts)

    def _run_task(self, slot: _Running) -> None:
        task = slot.task
        registered = self.queue.registered(task.name)
        if logger.isEnabledFor(logging.INFO):  # (its fields are not built for nothing)
            logger.info(
                "task %d %s attempt %d started",
                *_ids(task),
                task.attempts,
                extra=task_fields(task, self.worker_id),
            )
        self._hook(self.on_start, task)
        if slot.lease_lost or time.monotonic() >= kill_at(slot.renewed_at, self._lease_seconds):
            # Claimed, but not started before its lease could end (the process
            # was stopped, say): another worker may hold it by now.
            logger.warning("task %d %s: not started, its lease may have ended meanwhile", *_ids(task))
            slot.lease_lost = True
            self._finished(slot)
            return
        if task.malformed is not None:
            outcome = Outcome(error=MalformedTask(task.malformed))  # it cannot run: it fails, unrun
        elif registered is None:
            # Only registered functions run: a row's name is never imported.
            outcome = Outcome(error=TaskNotRegistered(task.name))
        elif registered.options.transactional:
            if slot.given_back:
                return
            outcome = self._run_transactional(slot, registered)
        elif self.isolation == "process":
            with slot.lock:
                if slot.given_back:
                    return
                slot.child = ChildProcess(registered.func, task.params, self._after_fork)
            outcome = self._wait_for_process(slot, slot.child, registered.options.timeout)
            if self._watchdog is not None and slot.child.pid is not None:
                self._watchdog.gone(slot.child.pid)
        else:
            if slot.given_back:
                return
            if registered.is_async:
                timeout = registered.options.timeout
                outcome = run_on_loop(
                    registered.func, task.params, timeout, self._task_loop(), partial(self._started, slot)
                )
            else:
                outcome = run_in_thread(registered.func, task.params, registered.options.timeout)
        given_back = self._finished(slot)
        if given_back or isinstance(outcome.error, GivenBack) or outcome.committed is False:
            return
        if outcome.ok and not outcome.committed and outcome.result is not None:
            try:
                check_result(outcome.result)
            except TypeError as error:
                # A result no database can store (not JSON): the run failed
                # as far as anyone reading the row can tell, hooks included.
                outcome = Outcome(error=error)
        duration = time.monotonic() - slot.started
        if outcome.error is None:
            with self._lock:
                self.processed += 1
            if logger.isEnabledFor(logging.INFO):
                logger.info(
                    "task %d %s attempt %d done in %.3fs",
                    *_ids(task),
                    task.attempts,
                    duration,
                    extra=task_fields(task, self.worker_id, duration=duration),
                )
            if not outcome.committed:  # (a transactional task's completion is written already)
                if self._write_outcome(slot, outcome.result, None, self.on_success):
                    return  # the slot is freed once the success is written; there is no hook to call
            else:
                self._no_success(slot)
            self._hook(self.on_success, task, outcome.result)
        else:
            with self._lock:
                self.failed += 1
            logger.warning(
                "task %d %s attempt %d failed after %.3fs: %s",
                *_ids(task),
                task.attempts,
                duration,
                error_message(outcome.error),
                extra=task_fields(
                    task, self.worker_id, duration=duration, error=error_message(outcome.error)
                ),
            )
            if not self._write_outcome(slot, None, outcome.error_text or outcome.error, self.on_failure):
                self._hook(self.on_failure, task, outcome.error)

    def _run_transactional(self, slot: _Running, registered: RegisteredTask[Any, Any]) -> Outcome:
        """Run a transactional task, then commit its writes with its completion, or roll them back.

        The commit is written only while the run succeeded in time and the
        worker still counts the task as its own (not given back, its lease
        not lost): a sync task that outran its timeout, or was given up while
        its thread ran on, can never commit.  The fenced UPDATE decides the
        rest (`sa_taskqueue.features.transactional`).  A failure is returned, its
        writes rolled back, for the ordinary fail path.
        """
        task = slot.task
        timeout = registered.options.timeout
        settle: Callable[[Any, bool], bool]
        if registered.is_async:
            loop = self.queue.event_loop()  # where the queue's AsyncEngine's connections live
            async_run = AsyncRun(self.queue, registered.func)
            outcome = run_on_loop(async_run.call, task.params, timeout, loop, partial(self._started, slot))

            def settle(result: Any, commit: bool) -> bool:
                coroutine = async_run.settle(task, result, commit=commit)
                return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

        else:
            sync_run = SyncRun(self.queue, registered.func)
            outcome = run_in_thread(sync_run.call, task.params, timeout)

            def settle(result: Any, commit: bool) -> bool:
                return sync_run.settle(task, result, commit=commit)

        if not outcome.ok:
            settle(None, False)  # (rolled back already, unless it failed after the call)
            return outcome
        may_commit = not (slot.given_back or slot.lease_lost)
        slot.completing = True  # (the loop claims for the other free slots meanwhile)
        try:
            committed = settle(outcome.result, may_commit)
        except Exception as error:  # noqa: BLE001 - recorded as the task's failure, its writes rolled back
            slot.completing = False  # still RUNNING and this worker's, until the fail path writes
            return Outcome(error=error)
        finally:
            self._wake.set()
        # ``completing`` stays set until the slot is freed: the row has left
        # RUNNING, and a lease renewal in between must not take that for a
        # lease taken over.
        try:
            self.queue.let_go(task)
        except Exception:
            logger.exception("task %d %s: could not let go of its claim", *_ids(task))
        if not committed:
            log_lease_lost(task)
        return replace(outcome, committed=committed)

    def _started(self, slot: _Running, future: Future[Outcome]) -> bool:
        """Keep an async run's future, for giving it back; False if it was given back already."""
        with slot.lock:
            slot.coroutine = future
            return not slot.given_back

    def _task_loop(self) -> asyncio.AbstractEventLoop:
        """The loop ``async def`` tasks run on (see the class docstring)."""
        if self._event_loop is not None:
            return self._event_loop
        if self.queue.is_async:
            return self.queue.event_loop()
        with self._lock:
            if self._own_loop is None:
                self._own_loop = LoopThread("sa_taskqueue-tasks")
            return self._own_loop.loop

    def _watchdog_lost(self, error: OSError) -> None:
        logger.error(
            "the watchdog process is gone (%s): stopping, as nothing would stop a task whose lease ran out",
            error,
        )
        self.stop()

    def _finished(self, slot: _Running) -> bool:
        """The run is over: its lease no longer needs guarding, only its outcome writing.

        True if it was given back meanwhile: then nothing of it is to be written.
        """
        with self._lock:
            slot.finished = True
            self._arm_locked()
            return slot.given_back

    def _arm_locked(self, extra: _Running | None = None, *, exact: bool = False) -> None:
        """Tell the watchdog when the first lease of a running task would end unrenewed (under ``_lock``).

        Only the heartbeat arms ``exact``ly.  Elsewhere a kill moving later
        may wait while the one armed is more than two heartbeats away, since
        the heartbeat arms again within one.
        """
        if self._watchdog is None:
            return
        lease = self._lease_seconds
        slack = None if exact else self._arm_slack
        if slack is not None and self._watchdog.armed_beyond(
            slack, not_after=kill_at(extra.renewed_at, lease) if extra else None
        ):
            # Slots only leave, finish or lose their lease between exact arms,
            # which moves no lease sooner; a claim's lease (``extra``) ends no
            # sooner than the kill armed: nothing would be sent, so the work
            # of finding the first lease to end is skipped.
            return
        guarded = [
            slot.renewed_at
            for slot in [*self._running.values(), *([extra] if extra else [])]
            if not slot.finished and not slot.lease_lost
        ]
        self._watchdog.arm(kill_at(min(guarded), lease) if guarded else None, unless_sooner_than=slack)

    def _after_fork(self) -> None:
        # The child inherited the pool's connections; it must not use them,
        # nor close them (closing sends the server a goodbye that would end
        # the parent's sessions).  The task opens fresh ones if it needs any.
        self.queue.engine.dispose(close=False)
        if self._watchdog is not None:
            register_child(self._watchdog.fileno)

    def _write_outcome(
        self,
        slot: _Running,
        result: Any,
        error: BaseException | str | None,
        hook: Callable[..., None] | None,
    ) -> bool:
        """Record a success (or, given ``error``, a failure) in one statement with others' ending meanwhile.

        With no ``hook`` to call once it is written, the outcome is handed
        over and the slot's thread moves on at once (True): the slot is
        freed when the write is done.  Otherwise this returns once it is
        written (False), for the caller to call the hook.
        """
        task = slot.task
        slot.reported = True
        slot.completing = True
        handed_off = False
        try:
            if hook is None:
                slot.handed_off = True
                self._completions.hand_off(task, result, partial(self._written, slot), error=error)
                handed_off = True
                return True
            try:
                recorded = self._completions.record(task, result, error=error)
            finally:
                slot.writing = False
        finally:
            if not handed_off:
                slot.completing = False
                self._wake.set()  # the loop may be waiting for this write before it claims
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *_ids(task))
        return False

    def _written(self, slot: _Running, recorded: bool | None) -> None:
        """An outcome handed over is written (on whichever thread wrote it): free its slot."""
        slot.writing = False
        slot.completing = False
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *_ids(slot.task))
        self._free(slot)

    def _write_successes(self, tasks: Sequence[ClaimedTask], results: Sequence[Any]) -> set[int] | None:
        claim = self._claim_with_write(tasks)
        if claim is None:
            self._writing(tasks)
            return self._through_outage(
                lambda: self.queue.complete_many(tasks, results),
                tasks,
                partial(self._all_landed, tasks, completed=True),
            )
        number, limit, free_now = claim
        sent_at = [time.monotonic()]
        claimed: list[ClaimedTask] = []

        def complete_and_claim() -> set[int]:
            sent_at[0] = time.monotonic()  # (each try through an outage claims afresh)
            written, claimed[:] = self.queue.complete_many_and_claim(
                tasks,
                results,
                limit=limit,
                queues=self.queues,
                worker_id=self.worker_id,
                names=self.queue.task_names,
            )
            return written

        try:
            return self._through_outage(
                complete_and_claim, tasks, partial(self._all_landed, tasks, completed=True)
            )
        finally:
            # Given to slots once this write's slots are freed (`_admit_claimed_with_write`).
            self._claimed_with_write = (claimed, sent_at[0], number, free_now)

    def _admit_claimed_with_write(self) -> None:
        """After a batch is written and its slots freed: give what its write claimed to slots.

        Admitted only now, the slot threads freed by the write take up the
        new tasks at once, with the writing thread done with the old batch.
        """
        claimed = self._claimed_with_write
        if claimed is None:
            return
        self._claimed_with_write = None
        try:
            self._admit(*claimed)
        finally:
            self._wake.set()  # the loop claims for any slot this claim left free

    def _claim_with_write(self, tasks: Sequence[ClaimedTask]) -> tuple[int, int, int] | None:
        """Whether the write of ``tasks``' successes claims too: the claim's number, limit and slots free now.

        It claims for the slots free now and for those it frees, unless the
        loop is claiming already, the worker is stopping, other tasks of the
        batch still run where slots claim ahead (PostgreSQL), or the
        database sends the two apart anyway.  None if not: the loop claims then.
        """
        if not self._claims_with_writes:
            return None
        ids = {task.id for task in tasks}
        with self._lock:
            if self._loop_claiming or self._write_claiming or self._stopping.is_set() or self._database_down:
                return None
            freeing = 0
            for slot in self._running.values():
                if slot.task.id in ids and slot.completing:
                    slot.writing = True
                    freeing += 1
            free_now = self.concurrency - len(self._running) - self._slot_claiming
            if free_now + freeing <= 0 or (self._claims_ahead and self._batch_still_running_locked()):
                # (Tasks of its claim, or of a later one, still run: where
                # slots claim ahead the loop waits for their slots too, and
                # claims for all together.  Claimed for these slots alone,
                # the next batch would be as split as this one, and so on.
                # Elsewhere the loop claims for slots as soon as they are
                # free, so the write may as well claim for them itself.)
                return None
            self._write_claiming = True
            return self._next_claim_locked(), free_now + freeing, free_now

    def _write_failures(
        self, tasks: Sequence[ClaimedTask], errors: Sequence[BaseException | str]
    ) -> set[int] | None:
        self._writing(tasks)
        return self._through_outage(
            lambda: self.queue.fail_many(tasks, errors),
            tasks,
            partial(self._all_landed, tasks, completed=False),
        )

    def _writing(self, tasks: Sequence[ClaimedTask]) -> None:
        """The outcomes of ``tasks`` are in a statement on its way: their slots free within a write."""
        ids = {task.id for task in tasks}
        with self._lock:
            for slot in self._running.values():
                if slot.task.id in ids and slot.completing:
                    slot.writing = True
        if self._claims_ahead:
            self._wake.set()  # the loop may claim ahead for these slots, during the write

    def _all_landed(self, tasks: Sequence[ClaimedTask], written: set[int], *, completed: bool) -> set[int]:
        return written | {
            task.id
            for task in tasks
            if task.id not in written and self.queue.outcome_written(task, completed=completed)
        }

    def _record_success(self, task: ClaimedTask, result: Any) -> None:
        self._record(task, Outcome(result=result))

    def _record(self, task: ClaimedTask, outcome: Outcome) -> None:
        """Write the outcome of one task: completed, or failed (retried later, or for good)."""
        if outcome.error is not None:
            self._record_failure(task, outcome.error_text or outcome.error)
            return
        try:
            recorded = self._through_outage(
                partial(self.queue.complete, task, outcome.result),
                [task],
                partial(self._landed, task, completed=True),
            )
        except TypeError as error:
            # A result that cannot be stored (not JSON): the run failed as
            # far as anyone reading the row can tell.
            self._record_failure(task, error)
            return
        except DatabaseError as error:
            # The database refused the result itself (e.g. NaN in JSON).
            logger.warning("task %d %s: its result cannot be stored: %s", *_ids(task), error)
            self._record_failure(task, error)
            return
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *_ids(task))

    def _record_failure(self, task: ClaimedTask, error: BaseException | str) -> None:
        """Write one task's failure on its own: retried later, or failed for good."""
        try:
            recorded = self._through_outage(
                partial(self.queue.fail, task, error),
                [task],
                partial(self._landed, task, completed=False),
            )
        except DatabaseError:
            logger.exception("task %d %s: could not record the failure", *_ids(task))
            return
        if recorded is False:
            logger.warning("task %d %s: outcome not recorded, the task was taken over", *_ids(task))

    def _landed(self, task: ClaimedTask, written: bool, *, completed: bool) -> bool:
        return written or self.queue.outcome_written(task, completed=completed)

    def _through_outage(
        self, write: Callable[[], T], tasks: Sequence[ClaimedTask], landed: Callable[[T], T]
    ) -> T | None:
        """``write()``, retried through a database outage while a lease lasts; None if it never got through.

        Giving up early would run the tasks again after their lease: at least
        once, but needlessly twice.  A write whose connection broke may have
        committed all the same, and then its retry finds the tasks no longer
        held: ``landed`` corrects what the retry reports by reading the rows.
        """
        retried = False
        backoff = 0.25
        # Past one lease from now the write would be refused anyway.
        give_up_at = time.monotonic() + self.queue.lease.total_seconds()
        while True:
            try:
                value = write()
            except DatabaseUnavailable as error:
                self._database_trouble(error, backoff)
                if time.monotonic() > give_up_at or self._stopped.is_set():
                    for task in tasks:
                        logger.error("task %d %s: outcome not recorded; it will run again", *_ids(task))
                    return None
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
                retried = True
                continue
            self._database_back()
            return landed(value) if retried else value

    def _hook(self, hook: Callable[..., None] | None, *args: Any) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("the %s hook raised", getattr(hook, "__name__", "worker"))

    # Retention ---------------------------------------------------------------

    def _retention(self) -> None:
        """Delete expired finished tasks every retention interval, beside the claim loop, never in it."""
        interval = self.queue.retention_interval
        assert interval is not None  # set whenever retention is
        while not self._stopping.is_set():
            try:
                deleted = self.queue.delete_expired(holder=self.worker_id, stop=self._stopping)
            except DatabaseUnavailable as error:
                self._database_trouble(error, interval.total_seconds())
            except Exception:
                logger.exception("deleting expired tasks failed; trying again in %s", interval)
            else:
                if deleted:
                    logger.info("deleted %d expired task(s)", deleted)
            self._stopping.wait(interval.total_seconds())

    # Heartbeat ---------------------------------------------------------------

    def _heartbeat(self) -> None:
        """Renew the leases of running tasks three times before the watchdog would act."""
        interval = self._heartbeat_seconds
        while not self._stopped.wait(interval):
            with self._lock:
                self._arm_locked(exact=True)  # before a renewal that may hang in an outage
            slots = [slot for slot in self._running_slots() if not slot.lease_lost]
            if slots:
                self._renew(slots, interval)
            with self._lock:
                self._arm_locked(exact=True)

    def _renew(self, slots: list[_Running], interval: float) -> None:
        sent_at = time.monotonic()
        try:
            renewed = self.queue.extend_leases([slot.task for slot in slots])
        except DatabaseUnavailable as error:
            self._database_trouble(error, interval)
            return
        except Exception:
            logger.exception("lease renewal failed; trying again in %.1fs", interval)
            return
        for slot in slots:
            if slot.task.id in renewed:
                slot.renewed_at = sent_at
            # (A task that just finished has its outcome written instead; a
            # transactional one may have committed it before its slot is freed.)
            elif not slot.finished and not slot.completing:
                self._give_up(slot, "its lease was taken over")

    def _wait_for_process(self, slot: _Running, child: ChildProcess, timeout: float | None) -> Outcome:
        """The outcome of a task process, stopped if its lease goes unrenewed (`_stop_unrenewed_at`)."""
        outcome = child.wait(timeout, partial(self._stop_unrenewed_at, slot))
        if outcome is None:
            if not slot.lease_lost:  # (else the heartbeat has stopped it already: taken over)
                self._give_up(slot, "its lease could not be renewed in time")
            return child.wait(None)  # killed: over at once
        return outcome

    def _stop_unrenewed_at(self, slot: _Running) -> float:
        """When a task process whose lease is not renewed is stopped: one heartbeat before the watchdog acts.

        The task's own thread, waiting on the process, keeps this time, not
        the heartbeat: a renewal can hang as long as a network partition
        lasts, and the watchdog would then end the whole worker.  Stopping
        the task alone lets the worker live on; its disarm reaches the
        watchdog through a pipe, not the database.  A thread cannot be
        stopped: under thread isolation the watchdog ends the whole process.
        """
        return kill_at(slot.renewed_at, self._lease_seconds) - self._heartbeat_seconds

    def _give_up(self, slot: _Running, why: str) -> None:
        """A running task is no longer this worker's: stop it if it can be stopped, record nothing."""
        slot.lease_lost = True
        if slot.child is not None:
            with slot.lock:
                slot.given_back = True
                slot.child.kill()
            logger.warning("task %d %s: %s; its process was stopped", *_ids(slot.task), why)
        elif slot.coroutine is not None:
            with slot.lock:
                slot.given_back = True
                slot.coroutine.cancel()
            logger.warning("task %d %s: %s; it was cancelled", *_ids(slot.task), why)
        else:
            logger.error(
                "task %d %s: %s, and a thread cannot be stopped: another worker may run it meanwhile",
                *_ids(slot.task),
                why,
            )

    # Database outages ----------------------------------------------------------

    def _database_trouble(self, error: BaseException, retry_in: float) -> None:
        """One clear line when the database goes away; quiet while it stays away.

        A transaction the server rolled back to end a deadlock is contention
        between workers, not an outage: it is logged for what it is, and
        the database is not taken for gone.
        """
        message = getattr(error, "orig", None) or error
        if self._lost_lock_race(error):
            logger.info("lost a lock race with another connection, trying again: %s", str(message).strip())
            return
        with self._lock:
            first = not self._database_down
            self._database_down = True
        if first:
            logger.error("database unavailable, retrying every few seconds: %s", str(message).strip())
        else:
            logger.debug("database still unavailable (next try in %.1fs): %s", retry_in, message)

    def _lost_lock_race(self, error: BaseException) -> bool:
        """Whether the server ended this statement's transaction as a deadlock's victim.

        (A lock wait that ran out is not: a lock held that long, by a
        migration or a stuck transaction, is trouble to be seen.)
        """
        cause = error.__cause__
        driver_error = getattr(cause, "orig", None) or cause
        if driver_error is None:
            return False
        return backend_for(self.queue.engine.dialect).lost_lock_race(driver_error)

    def _database_back(self) -> None:
        with self._lock:
            was_down = self._database_down
            self._database_down = False
        if was_down:
            logger.info("database is back")

    # Signals -------------------------------------------------------------------

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            name = signal.Signals(signum).name
            if self._stopping.is_set():
                logger.warning("received %s again: exiting now; leases will free the running tasks", name)
                with self._lock:
                    children = [slot.child for slot in self._running.values() if slot.child is not None]
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


def heartbeat_interval(lease_seconds: float) -> float:
    """How often running tasks' leases are renewed: three times before the watchdog would act."""
    return kill_at(0.0, lease_seconds) / 3


def _ids(task: ClaimedTask) -> tuple[int, str]:
    return task.id, task.name
