"""The slot runner: runs one claimed task in its slot, in a thread, a child process or on an event loop.

A slot's thread takes up its task (`take_up`), runs it (`run_task`), hands
its outcome to the outcome writer, and at shutdown what has not finished in
time is given back (`drain`): queued again, its attempt not counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from functools import partial
from typing import Any, Literal

from sa_taskqueue.core.claimed import ClaimedTask
from sa_taskqueue.core.current_task import (
    CancellationRequested,
    ProgressSink,
    TaskContext,
    reset_current,
    set_current,
)
from sa_taskqueue.core.error_text import error_message
from sa_taskqueue.core.event_loop_bridge import LoopThread
from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.exceptions import DatabaseUnavailable, MalformedTask, ParamTypeError, TaskNotRegistered
from sa_taskqueue.core.log_fields import task_fields
from sa_taskqueue.core.registered import RegisteredTask
from sa_taskqueue.core.validation import check_result
from sa_taskqueue.features.cancellation import write_cancelled
from sa_taskqueue.features.transactional import AsyncRun, SyncRun, log_lease_lost
from sa_taskqueue.worker.claim_loop import ClaimLoop
from sa_taskqueue.worker.execution import (
    CANCELLED_CLEANUP_WAIT,
    ChildProcess,
    GivenBack,
    Outcome,
    run_in_thread,
    run_on_loop,
)
from sa_taskqueue.worker.lease_keeper import LeaseKeeper
from sa_taskqueue.worker.lifecycle import Emitter
from sa_taskqueue.worker.outcome_writer import OutcomeWriter
from sa_taskqueue.worker.ports import WorkerQueue
from sa_taskqueue.worker.slots import Slot, WorkerState, ids
from sa_taskqueue.worker.watchdog import register_child

logger = logging.getLogger("sa_taskqueue")

Isolation = Literal["thread", "process"]

#: Times a transactional task cut off from the database by its connection is queued again,
#: its attempt not counted, before a further cut counts as its failure (in one worker).
FREE_GIVE_BACKS_AFTER_A_CUT = 3
#: Tasks whose cuts a worker remembers at most; past this it starts counting afresh.
MAX_CUTS_REMEMBERED = 10_000


def in_context(func: Callable[..., Any], context: TaskContext | None) -> Callable[..., Any]:
    """An ``async def`` task's function, run with its `TaskContext` current.

    A coroutine run on another thread's loop gets that loop's context, not
    the slot thread's: the context is set again inside the coroutine.
    """

    async def with_context(*args: Any, **params: Any) -> Any:
        # ``args``: a transactional task's session comes first.
        set_current(context)
        return await func(*args, **params)

    return with_context


class SlotRunner:
    """Runs tasks in their slots, and gives back what a shutdown leaves unfinished.

    ``hooked(failed)`` says whether a hook waits for the outcome (on_success,
    or with ``failed`` on_failure): the slot's thread then waits for the
    write, and the outcome's event, which calls the hook, is emitted on it.
    """

    def __init__(
        self,
        queue: WorkerQueue,
        state: WorkerState,
        claims: ClaimLoop,
        writer: OutcomeWriter,
        keeper: LeaseKeeper,
        emit: Emitter,
        *,
        isolation: Isolation,
        event_loop: asyncio.AbstractEventLoop | None,
        hooked: Callable[[bool], bool],
    ) -> None:
        self.queue = queue
        self.state = state
        self.claims = claims
        self.writer = writer
        self.keeper = keeper
        self.emit = emit
        self.isolation = isolation
        self.hooked = hooked
        self._event_loop = event_loop
        self._own_loop: LoopThread | None = None
        #: How often each task's connection was cut under it in this worker, by task id.
        self._cuts: dict[int, int] = {}
        #: Where the progress its tasks report goes (`sa_taskqueue.worker.progress`), and how it is let go of.
        self.progress_sink: ProgressSink | None = None
        self.forget_progress: Callable[[ClaimedTask], None] = lambda task: None

    def take_up(self, slot: Slot) -> None:
        """A slot's thread takes up its task, and the lone slot's next ones as it claims them."""
        next_slot: Slot | None = slot
        while next_slot is not None:
            slot = next_slot
            slot.thread = threading.current_thread()
            try:
                self.execute(slot)
            except BaseException as error:  # noqa: BLE001 - the thread serves the next slot all the same
                logger.error("a task slot ended with an error: %r", error)
                if not slot.handed_off:  # (else its write frees it)
                    self.claims.free(slot)
            next_slot = self.claims.claim_here()

    def never_taken_up(self, slot: Slot) -> None:
        """No thread took the task up before the worker stopped."""
        self.writer.no_success(slot)
        self.claims.free(slot)

    def execute(self, slot: Slot) -> None:
        """A slot's thread: run the task, record its outcome, free the slot (or leave that to the write)."""
        try:
            with slot.lock:
                given_back = slot.given_back
            if given_back:
                return  # given back by a shutdown before this thread took it up: not ours to start
            if (self.state.stopping.is_set() and slot.claimed_ahead) or slot.lease_lost:
                # Claimed ahead, and its slot came free only after a stop was
                # asked for, or its lease was lost: it does not start.  A task
                # claimed for a free slot starts, stop or not: it shows as
                # running from its claim, and shutdown_timeout bounds its run.
                self.writer.no_success(slot)
                self.give_back_unstarted(slot)
                return
            self.run_task(slot)
        except Exception as error:
            logger.exception(
                "task %d %s: the worker could not run it",
                *ids(slot.task),
                extra=task_fields(slot.task, self.state.worker_id, error=error_message(error)),
            )
            if not slot.handed_off:
                self.finished(slot)
                self.writer.no_success(slot)
                self.writer.record(slot.task, Outcome(error=error))
        finally:
            if not slot.handed_off:
                self.writer.no_success(slot)
                self.claims.free(slot)

    def give_back_unstarted(self, slot: Slot) -> None:
        """Give a task that never started back to the queue at once, rather than to its lease."""
        with slot.lock:
            slot.given_back = True
        if slot.lease_lost:
            return  # another worker may hold it by now: nothing of it is ours to write
        self._release(slot)

    def _release(self, slot: Slot) -> None:
        """Queue a task given back again; GIVEN_BACK once it is (with its run's duration if it started)."""
        try:
            released = self.queue.release(slot.task)
        except DatabaseUnavailable as error:
            logger.error("task %d %s: could not give it back (%s); its lease will", *ids(slot.task), error)
            return
        if released:
            with self.state.lock:
                self.state.given_back += 1
            self.emit.task(EventKind.GIVEN_BACK, slot.task, duration=slot.duration)

    def run_task(self, slot: Slot) -> None:
        task = slot.task
        registered = self.queue.registered(task.name)
        self.emit.task(EventKind.STARTED, task)
        if self.keeper.lease_ended(slot):
            # Claimed, but not started before its lease could end (the process
            # was stopped, say): another worker may hold it by now.
            logger.warning("task %d %s: not started, its lease may have ended meanwhile", *ids(task))
            slot.lease_lost = True
            self.finished(slot)
            self.emit.task(EventKind.LEASE_LOST, task)
            return
        slot.context = TaskContext(task, self.progress_sink, self.queue.parent_results)
        token = set_current(slot.context)
        try:
            outcome = self._run(slot, registered)
        finally:
            reset_current(token)
            if self.progress_sink is not None:
                self.forget_progress(task)
        if outcome is None:
            return
        given_back = self.finished(slot)
        if slot.cancel_requested and not given_back and not slot.lease_lost and not outcome.ok:
            self._write_cancelled(slot)
            return
        self._after_run(slot, outcome, given_back)

    def _run(self, slot: Slot, registered: RegisteredTask[Any, Any] | None) -> Outcome | None:
        """Run the task as its registration and the worker's isolation say; None if given back unstarted."""
        task = slot.task
        if slot.cancel_requested:
            return Outcome(error=CancellationRequested(task.id))  # cancelled before it began: it never does
        params = task.params
        mistyped: ParamTypeError | None = None
        if task.malformed is None and registered is not None:
            try:
                params = registered.call_params(task.params)
            except ParamTypeError as error:
                # A stored value that can never become its annotated type: malformed, so not retried.
                slot.task = task = replace(task, malformed=str(error))
                mistyped = error
        if mistyped is not None:
            outcome = Outcome(error=mistyped)
        elif task.malformed is not None:
            outcome = Outcome(error=MalformedTask(task.malformed))  # it cannot run: it fails, unrun
        elif registered is None:
            # Only registered functions run: a row's name is never imported.
            outcome = Outcome(error=TaskNotRegistered(task.name))
        elif registered.options.transactional:
            if slot.given_back:
                return None
            outcome = self.run_transactional(slot, registered, params)
        elif self.isolation == "process":
            with slot.lock:
                if slot.given_back:
                    return None
                if slot.cancel_requested:
                    return Outcome(error=CancellationRequested(task.id))
                report = None if self.progress_sink is None else partial(self.progress_sink, task)
                slot.child = ChildProcess(registered.func, params, partial(self._after_fork, slot), report)
            outcome = self._wait_for_process(slot, slot.child, registered.options.timeout)
            watchdog = self.keeper.watchdog
            if watchdog is not None and slot.child.pid is not None:
                watchdog.gone(slot.child.pid)
        else:
            if slot.given_back:
                return None
            if registered.is_async:
                timeout = registered.options.timeout
                outcome = run_on_loop(
                    in_context(registered.func, slot.context),
                    params,
                    timeout,
                    self._task_loop(),
                    partial(self._started, slot),
                )
            else:
                outcome = run_in_thread(registered.func, params, registered.options.timeout)
        return outcome

    def _after_run(self, slot: Slot, outcome: Outcome, given_back: bool) -> None:
        """Record a run's outcome: a success, a failure, or nothing for a run given back or taken over."""
        if given_back or isinstance(outcome.error, GivenBack) or outcome.committed is False:
            return
        if outcome.connection_cut and not self._cut_too_often(slot):
            self._give_back_cut(slot, outcome)
            return
        if outcome.ok and not outcome.committed and outcome.result is not None:
            try:
                check_result(outcome.result)
            except TypeError as error:
                # A result no database can store (not JSON): the run failed
                # as far as anyone reading the row can tell, hooks included.
                outcome = Outcome(error=error)
        slot.duration = time.monotonic() - slot.started
        if outcome.error is None:
            with self.state.lock:
                self.state.processed += 1
            if not outcome.committed:  # (a transactional task's completion is written already)
                self.writer.write(slot, outcome.result, None, wait=self.hooked(False))
            else:
                self.writer.no_success(slot)
                self.writer.announce(slot, EventKind.SUCCEEDED, outcome.result)
        else:
            with self.state.lock:
                self.state.failed += 1
            slot.error = outcome.error
            self.writer.write(slot, None, outcome.error_text or outcome.error, wait=self.hooked(True))

    def run_transactional(
        self, slot: Slot, registered: RegisteredTask[Any, Any], params: dict[str, Any]
    ) -> Outcome:
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
        run: SyncRun | AsyncRun
        if registered.is_async:
            loop = self.queue.event_loop()  # where the queue's AsyncEngine's connections live
            async_run = run = AsyncRun(self.queue, in_context(registered.func, slot.context))
            if not self._passed_gate(slot, run):
                return Outcome(error=GivenBack())
            outcome = run_on_loop(async_run.call, params, timeout, loop, partial(self._started, slot))

            def settle(result: Any, commit: bool) -> bool:
                coroutine = async_run.settle(task, result, commit=commit)
                return asyncio.run_coroutine_threadsafe(coroutine, loop).result()

        else:
            sync_run = run = SyncRun(self.queue, registered.func)
            if not self._passed_gate(slot, run):
                return Outcome(error=GivenBack())
            outcome = run_in_thread(sync_run.call, params, timeout)

            def settle(result: Any, commit: bool) -> bool:
                return sync_run.settle(task, result, commit=commit)

        if not outcome.ok:
            settle(None, False)  # (rolled back already, unless it failed after the call)
            return replace(outcome, connection_cut=run.cut)
        may_commit = not (slot.given_back or slot.lease_lost)
        slot.completing = True  # (the loop claims for the other free slots meanwhile)
        try:
            committed = settle(outcome.result, may_commit)
        except Exception as error:  # noqa: BLE001 - recorded as the task's failure, its writes rolled back
            slot.completing = False  # still RUNNING and this worker's, until the fail path writes
            # (The result is kept for a cut after the commit reached the server: see `_give_back_cut`.)
            return Outcome(result=outcome.result, error=error, connection_cut=run.cut)
        finally:
            self.state.wake.set()
        # ``completing`` stays set until the slot is freed: the row has left
        # RUNNING, and a lease renewal in between must not take that for a
        # lease taken over.
        try:
            self.queue.let_go(task)
        except Exception:
            logger.exception("task %d %s: could not let go of its claim", *ids(task))
        if not committed:
            log_lease_lost(task)
            self.emit.task(EventKind.LEASE_LOST, task)
        return replace(outcome, committed=committed)

    def _passed_gate(self, slot: Slot, run: SyncRun | AsyncRun) -> bool:
        """Wait at the database's write gate, where it has one, on this thread and before the timed run.

        False if the task was given back meanwhile (a shutdown): it does not start.
        """
        run.pass_gate()
        with slot.lock:
            if not slot.given_back:
                return True
        run.leave_gate()
        return False

    def _cut_too_often(self, slot: Slot) -> bool:
        """Whether the task's connection has been cut under it more often than a server's trouble explains.

        A restart cuts every connection once; a task whose own statements
        make the server drop its connection (a packet over MySQL's
        ``max_allowed_packet``, say) would be cut at every run, and is then
        failed like any other, so that it cannot run forever unfailed.
        """
        with self.state.lock:
            cuts = self._cuts.get(slot.task.id, 0) + 1
            if len(self._cuts) >= MAX_CUTS_REMEMBERED:
                self._cuts.clear()
            self._cuts[slot.task.id] = cuts
        return cuts > FREE_GIVE_BACKS_AFTER_A_CUT

    def _give_back_cut(self, slot: Slot, outcome: Outcome) -> None:
        """Queue again, its attempt not counted, a transactional task whose connection was cut as it ran.

        Its writes ended with the connection, so nothing of the run
        happened: it is given back, written through an outage like any
        outcome, rather than failed and made to wait for a retry.  Unless the
        cut came after its commit reached the server, only the answer lost:
        then the fenced give-back finds it completed, and its success stands.
        """
        task = slot.task
        why = error_message(outcome.error) if outcome.error is not None else "connection lost"
        slot.duration = time.monotonic() - slot.started
        given_back = self.writer.give_back(task)
        with contextlib.suppress(Exception):
            self.queue.let_go(task)  # (what else the strategy holds for it, once the row is written)
        if given_back:
            logger.warning(
                "task %d %s attempt %d: its connection was cut (%s); its writes were rolled back and it is "
                "queued again, the attempt not counted",
                *ids(task),
                task.attempts,
                why,
            )
            with self.state.lock:
                self.state.given_back += 1
            self.emit.task(EventKind.GIVEN_BACK, task, duration=slot.duration)
            return
        try:
            completed = self.queue.outcome_written(task, completed=True)
        except Exception:  # noqa: BLE001 - the database is away again: its lease decides
            completed = False
        if completed:
            logger.info("task %d %s: its connection was cut after its commit: it completed", *ids(task))
            with self.state.lock:
                self.state.processed += 1
            self.writer.no_success(slot)
            self.writer.announce(slot, EventKind.SUCCEEDED, outcome.result)
        else:
            logger.warning(
                "task %d %s: its connection was cut (%s), and it was taken over meanwhile", *ids(task), why
            )

    def _started(self, slot: Slot, future: Future[Outcome]) -> bool:
        """Keep an async run's future, for giving it back; False if it was given back already."""
        with slot.lock:
            slot.coroutine = future
            return not slot.given_back and not slot.cancel_requested

    def _task_loop(self) -> asyncio.AbstractEventLoop:
        """The loop ``async def`` tasks run on (see the `Worker` docstring)."""
        if self._event_loop is not None:
            return self._event_loop
        if self.queue.is_async:
            return self.queue.event_loop()
        with self.state.lock:
            if self._own_loop is None:
                self._own_loop = LoopThread("sa_taskqueue-tasks")
            return self._own_loop.loop

    def stop_own_loop(self) -> None:
        if self._own_loop is not None:
            self._own_loop.stop()
            self._own_loop = None

    def finished(self, slot: Slot) -> bool:
        """The run is over: its lease no longer needs guarding, only its outcome writing.

        True if it was given back meanwhile: then nothing of it is to be written.
        """
        with self.state.lock:
            slot.finished = True
            self.keeper.arm_locked()
            return slot.given_back

    def _write_cancelled(self, slot: Slot) -> None:
        """A cancelled run has stopped: write CANCELLED, fenced like every outcome, and say so."""
        task = slot.task
        slot.duration = time.monotonic() - slot.started
        queue = self.queue
        try:
            written = write_cancelled(queue.strategy, queue.engine, queue.table, task, queue.clock())
        except DatabaseUnavailable as error:
            logger.error("task %d %s: could not record its cancel (%s); its lease will", *ids(task), error)
            return
        if written:
            logger.info("task %d %s: cancelled while it ran", *ids(task))
            self.emit.task(EventKind.CANCELLED, task, duration=slot.duration)
        else:
            logger.warning("task %d %s: cancelled, but taken over meanwhile: nothing recorded", *ids(task))
            self.emit.task(EventKind.LEASE_LOST, task, duration=slot.duration)

    def _after_fork(self, slot: Slot | None = None) -> None:
        # The child inherited the pool's connections; it must not use them,
        # nor close them (closing sends the server a goodbye that would end
        # the parent's sessions).  The task opens fresh ones if it needs any.
        self.queue.engine.dispose(close=False)
        watchdog = self.keeper.watchdog
        if watchdog is not None:
            register_child(watchdog.fileno)

    def _wait_for_process(self, slot: Slot, child: ChildProcess, timeout: float | None) -> Outcome:
        """The outcome of a task process, stopped if its lease goes unrenewed (see `LeaseKeeper`)."""

        def until() -> float:
            stop = self.keeper.stop_unrenewed_at(slot)
            return stop if slot.cancel_kill_at is None else min(stop, slot.cancel_kill_at)

        outcome = child.wait(timeout, until)
        while outcome is None and slot.cancel_kill_at is not None and time.monotonic() < slot.cancel_kill_at:
            outcome = child.wait(timeout, until)  # (cancelled meanwhile: wait on, to its grace)
        if outcome is None:
            if slot.cancel_kill_at is not None and time.monotonic() >= slot.cancel_kill_at:
                logger.warning(
                    "task %d %s: cancelled, and still running after its grace: killed", *ids(slot.task)
                )
                child.kill()
                return child.wait(None)
            if not slot.lease_lost:  # (else the heartbeat has stopped it already: taken over)
                self.keeper.give_up(slot, "its lease could not be renewed in time")
            return child.wait(None)  # killed: over at once
        return outcome

    # Shutdown -------------------------------------------------------------------

    def drain(self, shutdown_timeout: float) -> None:
        """Let running tasks finish within ``shutdown_timeout``, then give back the rest.

        A task whose run is over, its outcome still being written, is not
        given back: its success would then be refused, and it would run again.
        """
        state = self.state
        deadline = time.monotonic() + shutdown_timeout
        while (state.running or self.claims.slot_claiming) and time.monotonic() < deadline:
            state.wake.wait(min(0.1, max(deadline - time.monotonic(), 0)))
            state.wake.clear()
        with state.lock:
            self.claims.slots_closed = True  # a claim the lone slot still waits for is given back
            # Decided under the lock `finished` takes: a task is either given
            # back here or, finished first, has its outcome written.
            leftover = [slot for slot in state.running.values() if not slot.finished]
            for slot in leftover:
                with slot.lock:
                    slot.given_back = True
        state.abandoned = len(leftover)
        for slot in leftover:
            with slot.lock:
                if slot.child is not None:
                    slot.child.kill()
                if slot.coroutine is not None:
                    slot.coroutine.cancel()  # an async task stops at its next await
        self._await_cancelled([slot for slot in leftover if slot.coroutine is not None])
        now = time.monotonic()
        for slot in leftover:
            slot.duration = now - slot.started  # (a run given back unfinished: its event has a duration)
            self._release(slot)

    def _await_cancelled(self, slots: list[Slot]) -> None:
        """Wait, bounded, until cancelled async tasks have run their cleanup.

        A task given back while its coroutine still runs its ``finally`` or
        ``async with`` exit could be claimed and run by another worker
        meanwhile; its slot's thread returns once the coroutine has ended.
        """
        deadline = time.monotonic() + CANCELLED_CLEANUP_WAIT
        while time.monotonic() < deadline:
            with self.state.lock:
                if all(slot.finished for slot in slots):
                    return
            time.sleep(0.02)


__all__ = ["Isolation", "SlotRunner"]
