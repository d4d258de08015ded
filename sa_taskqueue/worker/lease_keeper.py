"""The lease keeper: renews the leases of running tasks, arms the watchdog, and lets go of lost ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.worker.lifecycle import Emitter
from sa_taskqueue.worker.outages import Outages
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.slots import Slot, WorkerState, ids
from sa_taskqueue.worker.watchdog import Watchdog, kill_at

logger = logging.getLogger("sa_taskqueue")


def heartbeat_interval(lease_seconds: float) -> float:
    """How often running tasks' leases are renewed: three times before the watchdog would act."""
    return kill_at(0.0, lease_seconds) / 3


class LeaseKeeper:
    """Keeps the leases of a worker's running tasks, and the watchdog that guards them.

    Its heartbeat renews them every third of the time before the watchdog
    would act; a task whose lease was taken over, or could not be renewed
    in time, is given up (`give_up`): stopped if it can be, never recorded.
    """

    def __init__(self, queue: WorkerQueue, state: WorkerState, outages: Outages, emit: Emitter) -> None:
        self.queue = queue
        self.state = state
        self.outages = outages
        self.emit = emit
        self.watchdog: Watchdog | None = None
        #: A renewal is on its way: the heartbeat cannot arm again until it returns.
        self._renewing = False
        #: Checks which of the renewed tasks were cancelled (`sa_taskqueue.worker.cancelling`).
        self.cancels: Callable[[list[Slot]], None] | None = None
        engine = queue.engine
        self._gate = backend_for(engine.dialect).write_gate(engine.url)
        self.lease_seconds = self.heartbeat_seconds = self._arm_slack = 0.0
        self.read_lease()

    def read_lease(self) -> None:
        """Note the lease and heartbeat in seconds, and the slack a later kill may be held back within.

        Read as the worker is made and again as each run starts, rather than
        twice for every task (see `arm_locked`).
        """
        self.lease_seconds = self.queue.lease.total_seconds()
        self.heartbeat_seconds = heartbeat_interval(self.lease_seconds)
        self._arm_slack = 2 * self.heartbeat_seconds

    def start_watchdog(self, on_lost: Callable[[OSError], None]) -> None:
        self.watchdog = Watchdog(on_lost)

    def close_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None

    def arm(self, *, exact: bool = False) -> None:
        with self.state.lock:
            self.arm_locked(exact=exact)

    def arm_locked(self, extra: Slot | None = None, *, exact: bool = False) -> None:
        """Tell the watchdog when the first lease of a running task would end unrenewed.

        (Under the state's lock.)  Only the heartbeat arms ``exact``ly.  Elsewhere a kill moving later
        may wait while the one armed is more than two heartbeats away, since
        the heartbeat arms again within one; but not while a renewal is on
        its way, which can hang as long as a network partition lasts: a
        worker whose tasks all end meanwhile would be killed by a deadline
        that guards nothing.
        """
        watchdog = self.watchdog
        if watchdog is None:
            return
        lease = self.lease_seconds
        slack = None if exact or self._renewing else self._arm_slack
        if slack is not None and watchdog.armed_beyond(
            slack, not_after=kill_at(extra.renewed_at, lease) if extra else None
        ):
            # Slots only leave, finish or lose their lease between exact arms,
            # which moves no lease sooner; a claim's lease (``extra``) ends no
            # sooner than the kill armed: nothing would be sent, so the work
            # of finding the first lease to end is skipped.
            return
        guarded = [
            slot.renewed_at
            for slot in [*self.state.running.values(), *([extra] if extra else [])]
            if not slot.finished and not slot.lease_lost
        ]
        watchdog.arm(kill_at(min(guarded), lease) if guarded else None, unless_sooner_than=slack)

    def heartbeat(self) -> None:
        """Renew the leases of running tasks three times before the watchdog would act."""
        interval = self.heartbeat_seconds
        while not self.state.stopped.wait(interval):
            self.arm(exact=True)  # before a renewal that may hang in an outage
            slots = [slot for slot in self.state.running_slots() if not slot.lease_lost]
            if slots:
                with self.state.lock:
                    self._renewing = True
                try:
                    self.renew(slots, interval)
                finally:
                    with self.state.lock:
                        self._renewing = False
            self.arm(exact=True)

    def renew(self, slots: list[Slot], interval: float) -> None:
        sent_at = time.monotonic()
        try:
            # Ahead of the transactional tasks waiting for the database's one
            # write lock, where it has one (`sa_taskqueue.backends.write_gate`).
            with self._renewal_passage():
                renewed = self.queue.extend_leases([slot.task for slot in slots])
        except DatabaseUnavailable as error:
            self.outages.trouble(error, interval, "heartbeat")
            return
        except Exception as error:
            logger.exception("lease renewal failed; trying again in %.1fs", interval)
            self.emit.worker(EventKind.SERVICE_ERROR, service="heartbeat", error=error)
            return
        for slot in slots:
            if slot.task.id in renewed:
                slot.renewed_at = sent_at
            # (A task that just finished has its outcome written instead; a
            # transactional one may have committed it before its slot is freed.)
            elif not slot.finished and not slot.completing:
                self.give_up(slot, "its lease was taken over")
        if self.cancels is not None:
            # One SELECT by primary key of the tasks still held: the cost of
            # learning of a cancel within one heartbeat (PostgreSQL hears it at once).
            self.cancels([slot for slot in slots if not slot.lease_lost])
        self.emit.worker(EventKind.WORKER_HEARTBEAT)

    def _renewal_passage(self) -> AbstractContextManager[object]:
        return self._gate.renewal() if self._gate is not None else nullcontext()

    def stop_unrenewed_at(self, slot: Slot) -> float:
        """When a task process whose lease is not renewed is stopped: one heartbeat before the watchdog acts.

        The task's own thread, waiting on the process, keeps this time, not
        the heartbeat: a renewal can hang as long as a network partition
        lasts, and the watchdog would then end the whole worker.  Stopping
        the task alone lets the worker live on; its disarm reaches the
        watchdog through a pipe, not the database.  A thread cannot be
        stopped: under thread isolation the watchdog ends the whole process.
        """
        return kill_at(slot.renewed_at, self.lease_seconds) - self.heartbeat_seconds

    def lease_ended(self, slot: Slot) -> bool:
        """Whether the claimed task's lease may have ended before it started."""
        return slot.lease_lost or time.monotonic() >= kill_at(slot.renewed_at, self.lease_seconds)

    def give_up(self, slot: Slot, why: str) -> None:
        """A running task is no longer this worker's: stop it if it can be stopped, record nothing."""
        slot.lease_lost = True
        if slot.child is not None:
            with slot.lock:
                slot.given_back = True
                slot.child.kill()
            logger.warning("task %d %s: %s; its process was stopped", *ids(slot.task), why)
        elif slot.coroutine is not None:
            with slot.lock:
                slot.given_back = True
                slot.coroutine.cancel()
            logger.warning("task %d %s: %s; it was cancelled", *ids(slot.task), why)
        else:
            logger.error(
                "task %d %s: %s, and a thread cannot be stopped: another worker may run it meanwhile",
                *ids(slot.task),
                why,
            )
        self.emit.task(EventKind.LEASE_LOST, slot.task, error=why)


__all__ = ["LeaseKeeper", "heartbeat_interval"]
