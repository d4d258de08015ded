"""`Completions`: outcomes that come together are written in one statement.

A worker's slots finish tasks independently.  Writing each success on its own
costs a statement per task; writing them together costs one per batch.  The
same goes for failures: those that come together are written in one statement
of their own (a batch holding both kinds costs two, one for each).  A
success waits, at most ``delay`` seconds, for the other tasks the worker has
claimed and not finished (counted from the claim, so a slot whose thread has
not taken up its task yet counts too), so that a claimed batch of quick tasks
is written in one statement rather than in as many as their ends happen to
straddle; it never waits once none is left, so a lone slot writes at once.
While one statement is on its way, the successes finishing behind it gather
into the next.

A success that finds its batch due (none left to wait for, or the delay
over) writes it on its own thread; a batch whose delay runs out with no
success arriving, or that waited behind another's write, is written by a
thread of the worker's own.  The other slots hand their successes over and
their threads move on (`hand_off`), told once written, on whichever thread
wrote them; or they wait for that (`record`).  Either way the worker frees a
slot only once the write of its outcome is over, so a freed slot means an
outcome written, or one the database could not be reached to write (the
task then runs again after its lease).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sa_taskqueue.core.claimed import ClaimedTask

logger = logging.getLogger("sa_taskqueue")

#: Writes many successes; the ids it wrote, or None if it could not get through at all.
WriteMany = Callable[[Sequence[ClaimedTask], Sequence[Any]], set[int] | None]
#: Writes one success on its own; used for a batch whose common write failed.
WriteOne = Callable[[ClaimedTask, Any], None]
#: Writes many failures, each task with its error; as `WriteMany` otherwise.
FailMany = Callable[[Sequence[ClaimedTask], Sequence[BaseException | str]], set[int] | None]
#: Writes one failure on its own; used for a batch whose common write failed.
FailOne = Callable[[ClaimedTask, BaseException | str], None]


#: Told whether a success handed over was recorded (see `Completions.record`).
Written = Callable[[bool | None], None]


@dataclass
class _Waiting:
    """An outcome waiting to be written, and whom to tell once it is."""

    task: ClaimedTask
    result: Any
    written: Written
    error: BaseException | str | None = None  # a failure's, to be written as `FailMany` writes it


class Completions:
    """Gathers the successes of a worker's slots into shared statements.

    The worker says when a task is claimed for a slot (`begin`) and when it
    ends without a success to write (`end_without_success`); `hand_off` or
    `record` ends it with one.  The tasks begun and not ended are the
    successes that may still join a batch.  ``delay`` bounds how long a
    success waits for them; 0 writes each batch as soon as no write is
    under way.  `start` starts the thread that writes the batches no
    success completes in time; `close` writes what waits and stops it.

    Given ``fail_many`` and ``fail_one``, a failure may end a task too
    (``error=`` to `hand_off` or `record`), waiting and told as a success
    is; without them a task that fails ends with `end_without_success`.
    ``after_write`` is called on the writing thread once each outcome of a
    batch is written and told, whatever became of the write.
    """

    def __init__(
        self,
        write_many: WriteMany,
        write_one: WriteOne,
        *,
        delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        fail_many: FailMany | None = None,
        fail_one: FailOne | None = None,
        after_write: Callable[[], None] | None = None,
    ) -> None:
        if not delay >= 0:
            raise ValueError(f"the completion delay must not be negative, got {delay!r}")
        if (fail_many is None) != (fail_one is None):
            raise ValueError("fail_many and fail_one are given together, or neither")
        self._write_many = write_many
        self._write_one = write_one
        self._fail_many = fail_many
        self._fail_one = fail_one
        self._after_write = after_write
        self._delay = delay
        self._clock = clock
        self._waiting: list[_Waiting] = []
        self._since: float | None = None  # when the oldest success waiting arrived
        self._running = 0  # tasks begun whose outcome is not known yet
        self._closing = False
        self._writing = False  # a batch is on its way: the next one waits for it
        self._changed = threading.Condition(threading.Lock())
        self._writer: threading.Thread | None = None
        self._serving = False  # the writing thread runs (set and cleared under the lock)

    def start(self) -> None:
        """Start the thread that writes the batches (again, after `close`)."""
        with self._changed:
            self._closing = False
            if self._serving:
                return  # (a close that timed out: its thread serves on)
            self._serving = True
            self._writer = threading.Thread(target=self._serve, name="sa_taskqueue-completions", daemon=True)
            self._writer.start()

    def close(self, timeout: float | None = None) -> None:
        """Write every success still waiting, at once, then stop the writing thread."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def begin(self, count: int = 1) -> None:
        """``count`` tasks are claimed for slots: successes that may join the next batch.

        A claim's tasks begin together, before any of them can end, so that
        none of their successes is written without the others'.
        """
        with self._changed:
            self._running += count

    def end_without_success(self) -> None:
        """A task begun has ended without a success to write (it failed, or was given back)."""
        with self._changed:
            self._end_locked()

    def hand_off(
        self, task: ClaimedTask, result: Any, written: Written, *, error: BaseException | str | None = None
    ) -> None:
        """End a task begun with its success, to be written with whatever else waits; return at once.

        ``written`` is called once it is written, with what `record` would
        return, on the thread that wrote it: this one when this success
        completes a batch due now (the last slot of a batch writes it, with
        no thread to wake), another slot's, or the writing thread's.  With
        ``error`` it is the task's failure that is written (``result`` is
        then ignored).
        """
        if error is not None and self._fail_many is None:
            raise ValueError("these completions write no failures: end the task with end_without_success")
        with self._changed:
            self._waiting.append(_Waiting(task, result, written, error))
            if not self._serving:
                # Before start or after close (a task given back, ending after
                # its worker returned): written here, once no write is on its way.
                while self._writing:
                    self._changed.wait()
                self._running = max(self._running - 1, 0)
                self._write_waiting()
                return
            first = self._since is None
            if first:
                self._since = self._clock()
            self._running = max(self._running - 1, 0)
            if not self._writing and self._time_left() == 0:
                self._write_waiting()
            elif first or self._running == 0:
                # The writing thread times the wait from the first success,
                # and writes the batch once the one on its way is written.
                self._changed.notify_all()

    def record(
        self, task: ClaimedTask, result: Any, *, error: BaseException | str | None = None
    ) -> bool | None:
        """End a task begun with its success (or its failure, ``error``); return once it is written.

        True if it was recorded, False if the task had been taken over (its
        claim no longer held it), None if the database could not be reached
        for as long as the lease lasted, or the batch fell back to one write
        per task (which reports for itself).
        """
        done = threading.Event()
        recorded: list[bool | None] = []

        def written(outcome: bool | None) -> None:
            recorded.append(outcome)
            done.set()

        self.hand_off(task, result, written, error=error)
        done.wait()
        return recorded[0]

    def _end_locked(self) -> None:
        self._running = max(self._running - 1, 0)
        if self._running == 0 and self._waiting:
            self._changed.notify_all()  # nothing else can join: the batch may go

    def _time_left(self) -> float | None:
        """How long the successes waiting may wait still (0: write now; None: nothing waits)."""
        if self._since is None:
            return None
        if self._running == 0 or self._closing:
            return 0.0
        return max(self._since + self._delay - self._clock(), 0.0)

    def _serve(self) -> None:
        """The writing thread: each batch once it is due, until closed with nothing waiting."""
        with self._changed:
            while True:
                wait_for = None if self._writing else self._time_left()
                if wait_for == 0:
                    self._write_waiting()
                    continue
                if wait_for is None and self._closing and not self._writing:
                    self._serving = False
                    return
                self._changed.wait(wait_for)

    def _write_waiting(self) -> None:
        """Write every success waiting, outside the lock (called under it; returns under it)."""
        batch, self._waiting, self._since = self._waiting, [], None
        if not batch:
            return  # (another writer took them)
        self._writing = True
        self._changed.release()
        try:
            self._write_batch(batch)
        finally:
            self._changed.acquire()
            self._writing = False
            if self._waiting or self._closing or not self._serving:
                # Successes that arrived meanwhile may be due; a closing
                # writing thread, or a caller after close, waits for this write.
                self._changed.notify_all()

    def _write_batch(self, batch: list[_Waiting]) -> None:
        try:
            successes = [item for item in batch if item.error is None]
            if successes:
                self._write_kind(successes, self._write_successes, self._write_success)
            if len(successes) < len(batch):
                failures = [item for item in batch if item.error is not None]
                self._write_kind(failures, self._write_failures, self._write_failure)
        finally:
            if self._after_write is not None:
                try:
                    self._after_write()  # (each told first: their slots are free by now)
                except Exception:
                    logger.exception("handling a written batch failed")

    def _write_successes(self, batch: list[_Waiting]) -> set[int] | None:
        return self._write_many([item.task for item in batch], [item.result for item in batch])

    def _write_success(self, item: _Waiting) -> None:
        self._write_one(item.task, item.result)

    def _write_failures(self, batch: list[_Waiting]) -> set[int] | None:
        assert self._fail_many is not None  # (hand_off takes no failure without it)
        return self._fail_many([item.task for item in batch], [_error(item) for item in batch])

    def _write_failure(self, item: _Waiting) -> None:
        assert self._fail_one is not None
        self._fail_one(item.task, _error(item))

    def _write_kind(
        self,
        batch: list[_Waiting],
        write_many: Callable[[list[_Waiting]], set[int] | None],
        write_one: Callable[[_Waiting], None],
    ) -> None:
        """Write outcomes of one kind in one statement, or one by one if that fails; tell each."""
        try:
            written = write_many(batch)
        except Exception:
            # The database refused a result, or something else went wrong
            # with the statement: each on its own, so only what fails fails.
            logger.debug("writing %d outcomes together failed; one by one", len(batch), exc_info=True)
            for item in batch:
                try:
                    write_one(item)
                except Exception:
                    logger.exception("task %d %s: could not record its outcome", item.task.id, item.task.name)
                self._tell(item, None)
            return
        for item in batch:
            self._tell(item, None if written is None else item.task.id in written)

    @staticmethod
    def _tell(item: _Waiting, recorded: bool | None) -> None:
        try:
            item.written(recorded)
        except Exception:
            logger.exception("task %d %s: handling its written outcome failed", item.task.id, item.task.name)


def _error(item: _Waiting) -> BaseException | str:
    assert item.error is not None  # (only failures are written as failures)
    return item.error


__all__ = ["Completions"]
