"""The claim loop: claims as many tasks as there are free slots, in one claim, and hands them to slots.

Where the database commits a completion and a claim at once, the write of a
batch's successes claims for the slots it frees (`claim_with_write`); with
one slot the slot's thread claims its next task itself (`claim_here`).  An
idle worker backs off from `MIN_POLL_INTERVAL` to ``poll_interval``, and is
woken by a notification, a freed slot or a stop.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.concurrency import LIMITED_RECHECK_SECONDS
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.worker.lease_keeper import LeaseKeeper
from sa_taskqueue.worker.lifecycle import Emitter
from sa_taskqueue.worker.outages import Outages
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.slot_threads import SlotThreads
from sa_taskqueue.worker.slots import Slot, WorkerState

if TYPE_CHECKING:
    from sa_taskqueue.worker.completions import Completions

logger = logging.getLogger("sa_taskqueue")

#: Longest pause between claims after database errors.
MAX_ERROR_BACKOFF = 30.0
#: The longest pause before claiming again after a claim lost a certification conflict (Galera).
CONFLICT_PAUSE = 0.05
#: The first poll after a claim came back short; doubled up to ``poll_interval``.
MIN_POLL_INTERVAL = 0.05


class ClaimLoop:
    """Claims for free slots, and frees them: the one part that decides how many tasks the worker holds.

    A claim is on its way from the loop, from a write of successes, or from
    the lone slot's thread, never two at once, so that no more tasks are
    claimed than there are slots for.
    """

    def __init__(
        self,
        queue: WorkerQueue,
        state: WorkerState,
        keeper: LeaseKeeper,
        outages: Outages,
        emit: Emitter,
        *,
        concurrency: int,
        queues: list[str] | None,
        burst: bool,
        poll_interval: float,
        completion_delay: float,
    ) -> None:
        self.queue = queue
        self.state = state
        self.keeper = keeper
        self.outages = outages
        self.emit = emit
        self.concurrency = concurrency
        self.queues = queues
        self.burst = burst
        #: Slots freed so far (their outcomes written): a burst worker looks again when any was
        #: freed during a claim that found nothing.
        self._freed_count = 0
        self.poll_interval = poll_interval
        self.completion_delay = completion_delay
        #: Whether the loop claims during writes, and whether a lone slot claims
        #: its next task on its own thread (see `claim_here`): set up by `run`,
        #: where the backend is known.
        self.claims_ahead = False
        self.claims_in_slot = False
        #: The lone slot, just freed, is claiming its next task itself: not free for the loop.
        self.slot_claiming = False
        #: Set by the drain once it has decided what to give back: a task the lone
        #: slot claims after that is given back unstarted.
        self.slots_closed = False
        #: The claims the loop has sent, and the oldest claim of the slots freed since the last one.
        self._claims_sent = 0
        self._oldest_freed: int | None = None
        #: Whether a write of successes claims the next tasks in the same
        #: commit (`claim_with_write`): set up by `run`.
        self._claims_with_writes = False
        #: A claim is on its way: the loop's own, or one sent with a write of
        #: successes.  Neither is sent while the other is.
        self._loop_claiming = False
        self._write_claiming = False
        #: What a write of successes claimed, given to slots once the slots it frees are free.
        self.claimed_with_write: tuple[list[ClaimedTask], float, int, int] | None = None
        self._pool: SlotThreads[Slot] | None = None
        self._completions: Completions | None = None
        self._give_back_unstarted: Callable[[Slot], None] = lambda _slot: None

    def bind(self, completions: Completions, give_back_unstarted: Callable[[Slot], None]) -> None:
        """The outcome writer's completions (each claimed task begins there) and the runner's give-back."""
        self._completions = completions
        self._give_back_unstarted = give_back_unstarted

    def run(self, pool: SlotThreads[Slot]) -> None:
        """Claim for free slots until stopped (or, with ``burst``, until nothing is due and nothing runs)."""
        state = self.state
        backend = backend_for(self.queue.engine.dialect)
        self._gate = backend.write_gate(self.queue.engine.url)
        claim_ahead = self.claims_ahead = backend.claims_ahead
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
        self.claims_in_slot = self.concurrency == 1 and not claim_ahead and not self._claims_with_writes
        self._pool = pool
        self.slots_closed = False
        idle_delay = MIN_POLL_INTERVAL
        error_backoff = 0.0
        gathering_since: float | None = None  # (monotonic) some slots free, waiting for the rest
        while not state.stopping.is_set():
            batch_running = False
            with state.lock:
                # Slots whose outcome waits for, or is in, a batch being
                # written free up within a write from now.  (Not slots in
                # hooks, or writing an outcome alone: those may take long.)
                completing = any(slot.completing for slot in state.running.values())
                writing = sum(1 for slot in state.running.values() if slot.writing)
                free = self.concurrency - len(state.running) - self.slot_claiming
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
                batch_running = free > 0 and self.batch_still_running_locked()
                if self._write_claiming:
                    free = 0  # a write claims for every slot free or writing: it wakes this loop when done
            if free <= 0:
                gathering_since = None
                self.wait(None)
                continue
            if completing and not claim_ahead:
                # Claim for them once they free, in one claim with the rest.
                self.wait(self.poll_interval)
                continue
            if batch_running:
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
                    self.wait(left)
                    continue
            gathering_since = None
            state.wake.clear()
            with state.lock:
                if self._write_claiming or self._claims_sent != counted_at:
                    continue  # (a write claimed since the slots were counted: count them again)
                self._loop_claiming = True
                claim = self.next_claim_locked()
            with state.lock:
                freed_before = self._freed_count
            try:
                sent_at, claimed = self.claim_passed(free)
            except DatabaseUnavailable as error:
                with state.lock:
                    self._loop_claiming = False
                if self.outages.certification_conflict(error):
                    # Another node's claim took these rows first: claim again
                    # at once (after a moment, so that two nodes do not meet
                    # again in step), without backing off as from an outage.
                    self.outages.trouble(error, 0.0)
                    state.stopping.wait(random.uniform(0.0, CONFLICT_PAUSE))
                    continue
                error_backoff = min(max(error_backoff * 2, 0.5), MAX_ERROR_BACKOFF)
                self.outages.trouble(error, error_backoff)
                state.stopping.wait(error_backoff)
                continue
            except BaseException:
                with state.lock:
                    self._loop_claiming = False
                raise
            error_backoff = 0.0
            self.outages.back()
            self.admit(claimed, sent_at, claim, free_now)
            if len(claimed) == free:
                idle_delay = MIN_POLL_INTERVAL
                continue  # every slot taken: wait for one below, then claim again
            if not claimed and self.burst:
                with state.lock:
                    # (Nor a write's claim on its way: its tasks would be given back.)  Nor an
                    # outcome written since this claim looked: it may have released dependents
                    # the claim could not see yet, so it looks once more first.
                    idle = (
                        not state.running and not self._write_claiming and self._freed_count == freed_before
                    )
                if idle:
                    return
            if not claimed:
                with state.lock:
                    if not state.running:
                        # Idle: a disarm held back (see LeaseKeeper.arm_locked) is sent now.
                        self.keeper.arm_locked(exact=True)
            # A short claim: poll again soon, backing off while nothing comes.
            idle_delay = MIN_POLL_INTERVAL if claimed else min(idle_delay * 2, self.poll_interval)
            # Jitter below the delay, so that idle workers spread out and no
            # wait exceeds poll_interval.
            delay = idle_delay * random.uniform(0.8, 1.0)
            logger.debug("nothing more due: next poll in %.2fs", delay)
            self.wait(delay)

    def batch_still_running_locked(self) -> bool:
        """Whether a task of a freed or writing slot's claim, or of a later claim, is yet to be written.

        (Under the state's lock.)  Where slots claim ahead, those tasks' slots
        are the ones worth waiting for: still running, or their outcome
        waiting for a write, they free within a task's run and a write of the
        others.  Not a slot in a hook, its outcome written: it may take long.
        """
        running = self.state.running.values()
        oldest = self._oldest_freed
        for slot in running:
            if slot.writing and (oldest is None or slot.claim < oldest):
                oldest = slot.claim
        if oldest is None:
            return False
        return any(
            slot.claim >= oldest and not slot.writing and (not slot.finished or slot.completing)
            for slot in running
        )

    def claim_passed(self, limit: int) -> tuple[float, list[ClaimedTask]]:
        """`claim`, through the database's write gate where it has one; when it was sent, and what it claimed.

        In line with the transactional tasks for SQLite's one write lock, a
        claim is let in as the lock comes free, rather than polling for it
        while the tasks pass it on among themselves.  Its lease runs from
        its passage, not from the wait before it.
        """
        sent_at = time.monotonic()
        try:
            if self._gate is None:
                claimed = self.claim(limit)
            else:
                with self._gate.writer():
                    sent_at = time.monotonic()
                    claimed = self.claim(limit)
        except BaseException as error:
            self.emit.statement("claim", sent_at, 0, error)
            raise
        self.emit.statement("claim", sent_at, len(claimed))
        return sent_at, claimed

    def claim(self, limit: int) -> list[ClaimedTask]:
        """Claim up to ``limit`` due tasks of this worker's queues and registered names."""
        return self.queue.claim(
            limit=limit,
            queues=self.queues,
            worker_id=self.state.worker_id,
            names=self.queue.task_names,
            limited_recheck=LIMITED_RECHECK_SECONDS,
        )

    def next_claim_locked(self) -> int:
        """Number the claim about to be sent (under the state's lock)."""
        self._claims_sent += 1
        self._oldest_freed = None  # (slots freed from now on are this claim's to wait for)
        return self._claims_sent

    def _claimed(self, tasks: Sequence[ClaimedTask]) -> None:
        if self.emit.events.wants(EventKind.CLAIMED):
            for task in tasks:
                self.emit.task(EventKind.CLAIMED, task)

    def admit(self, claimed: list[ClaimedTask], sent_at: float, claim: int, free_now: int) -> None:
        """Give the tasks of claim number ``claim`` to slots, and end that claim.

        The first ``free_now`` go to slots free at the claim; the rest were
        claimed ahead for slots still writing.  Their leases run from
        ``sent_at``, when the claim was sent.  Claimed once the drain has
        decided what to give back, they are given back unstarted.
        """
        state = self.state
        slots = [
            Slot(task, renewed_at=sent_at, claimed_ahead=index >= free_now, claim=claim)
            for index, task in enumerate(claimed)
        ]
        with state.lock:
            self._loop_claiming = self._write_claiming = False
            closed = self.slots_closed
            if slots and not closed:
                # Armed before a task can start: their leases run from the claim.
                self.keeper.arm_locked(extra=slots[0])
                for slot in slots:
                    state.running[id(slot)] = slot
        self._claimed(claimed)
        if closed:
            for slot in slots:
                self._give_back_unstarted(slot)
            return
        if slots:
            # Each ended by its success, or by no_success; all before any can end.
            assert self._completions is not None
            self._completions.begin(len(slots))
        assert self._pool is not None  # (set by run before any claim)
        for slot in slots:
            self._pool.submit(slot)

    def wait(self, timeout: float | None) -> None:
        """Sleep until a slot frees, a notification arrives, a stop is asked for, or ``timeout``."""
        self.state.wake.wait(timeout)
        self.state.wake.clear()

    def claim_here(self) -> Slot | None:
        """The lone slot, freed on this thread by its own write, claims its next task here.

        None if it is not to (`free` decides), or nothing was claimed: the
        loop claims again then, as it does for any free slot.  A task claimed
        once the drain has decided what to give back is given back unstarted.
        """
        state = self.state
        with state.lock:
            # (Not once the main thread has ended either: the interpreter is
            # exiting, and this non-daemon thread must not keep it running.)
            if not self.slot_claiming or state.stopping.is_set() or not threading.main_thread().is_alive():
                self._hand_claims_back()
                return None
        sent_at = time.monotonic()
        try:
            sent_at, claimed = self.claim_passed(1)
        except DatabaseUnavailable as error:
            logger.debug("the slot's own claim failed (%s): the worker's loop claims again", error)
            claimed = []
        except Exception:
            logger.exception("the slot's own claim failed: the worker's loop claims again")
            claimed = []
        if not claimed:
            with state.lock:
                self._hand_claims_back()
            return None
        slot = Slot(claimed[0], renewed_at=sent_at)
        with state.lock:
            self.slot_claiming = False
            closed = self.slots_closed
            if not closed:
                self.keeper.arm_locked(extra=slot)  # before it can start: its lease runs from the claim
                state.running[id(slot)] = slot
        self._claimed(claimed)
        if closed:
            self._give_back_unstarted(slot)
            return None
        self.outages.back()
        assert self._completions is not None
        self._completions.begin(1)
        return slot

    def _hand_claims_back(self) -> None:
        """The loop claims for the lone slot again (under the state's lock)."""
        if self.slot_claiming:
            self.slot_claiming = False
            self.state.wake.set()

    def free(self, slot: Slot) -> None:
        """The slot's task is done with, its outcome written: another may be claimed for it.

        Freed on its own thread, the lone slot claims its next task there
        (`claim_here`); the loop, not woken, goes on waiting.
        """
        state = self.state
        with state.lock:
            freed = state.running.pop(id(slot), None)
            self._freed_count += 1
            if freed is not None and (self._oldest_freed is None or slot.claim < self._oldest_freed):
                self._oldest_freed = slot.claim
            claims_here = (
                freed is not None
                and self.claims_in_slot
                and slot.thread is threading.current_thread()
                and not state.running
                and not state.stopping.is_set()
            )
            if claims_here:
                self.slot_claiming = True
            self.keeper.arm_locked()
        if freed is None:
            return
        if slot.task.concurrency_key is not None:
            self.queue.recheck_limited()  # its key has a free slot now
        if not claims_here and not state.wake.is_set():
            state.wake.set()

    def notified(self, queue_name: str) -> None:
        """A task was enqueued (a NOTIFY): claim now if it is in one of this worker's queues."""
        if not queue_name or self.queues is None or queue_name in self.queues:
            self.queue.recheck_limited()
            self.state.wake.set()

    def pause_changed(self, _queue_name: str) -> None:
        """A queue was paused or resumed: read the paused queues again, and claim now.

        (A resumed queue may hold due tasks.)
        """
        self.queue.paused.invalidate()
        self.state.wake.set()

    # Claims sent with a write of successes ----------------------------------------

    def claim_with_write(self, tasks: Sequence[ClaimedTask]) -> tuple[int, int, int] | None:
        """Whether the write of ``tasks``' successes claims too: the claim's number, limit and slots free now.

        It claims for the slots free now and for those it frees, unless the
        loop is claiming already, the worker is stopping, other tasks of the
        batch still run where slots claim ahead (PostgreSQL), or the
        database sends the two apart anyway.  None if not: the loop claims then.
        """
        if not self._claims_with_writes:
            return None
        state = self.state
        ids = {task.id for task in tasks}
        with state.lock:
            if self._loop_claiming or self._write_claiming or state.stopping.is_set() or self.outages.down:
                return None
            freeing = 0
            for slot in state.running.values():
                if slot.task.id in ids and slot.completing:
                    slot.writing = True
                    freeing += 1
            free_now = self.concurrency - len(state.running) - self.slot_claiming
            if free_now + freeing <= 0 or self.batch_still_running_locked():
                # (Tasks of its claim, or of a later one, still run: the
                # loop waits a little for their slots too, and claims for
                # all together.  Claimed for these slots alone, the next
                # batch would be as split as this one, and so on.)
                return None
            self._write_claiming = True
            return self.next_claim_locked(), free_now + freeing, free_now

    def admit_claimed_with_write(self) -> None:
        """After a batch is written and its slots freed: give what its write claimed to slots.

        Admitted only now, the slot threads freed by the write take up the
        new tasks at once, with the writing thread done with the old batch.
        """
        claimed = self.claimed_with_write
        if claimed is None:
            return
        self.claimed_with_write = None
        try:
            self.admit(*claimed)
        finally:
            self.state.wake.set()  # the loop claims for any slot this claim left free

    def writing(self, tasks: Sequence[ClaimedTask]) -> None:
        """The outcomes of ``tasks`` are in a statement on its way: their slots free within a write."""
        ids = {task.id for task in tasks}
        with self.state.lock:
            for slot in self.state.running.values():
                if slot.task.id in ids and slot.completing:
                    slot.writing = True
        if self.claims_ahead:
            self.state.wake.set()  # the loop may claim ahead for these slots, during the write


__all__ = ["MAX_ERROR_BACKOFF", "MIN_POLL_INTERVAL", "ClaimLoop"]
