"""The worker loop: claim, run, complete or fail, renew leases.  No SQL of its own."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from types import FrameType
from typing import TYPE_CHECKING, Any

from sqlalchemy import exc as sa_exc

from sa_taskqueue.claimed import ClaimedTask
from sa_taskqueue.exceptions import DatabaseUnavailable, TaskNotRegistered

if TYPE_CHECKING:
    from sa_taskqueue.queue import TaskQueue

logger = logging.getLogger("sa_taskqueue")

#: Errors after which the worker waits and tries again rather than stopping.
TRANSIENT_ERRORS = (DatabaseUnavailable, sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError)

#: Longest pause between claims after database errors.
MAX_ERROR_BACKOFF = 30.0


class Worker:
    """Runs a queue's registered tasks in ``concurrency`` threads.

    Each loop claims as many tasks as there are free slots in one claim.  A
    heartbeat thread renews the leases of running tasks every third of the
    lease, so a task longer than the lease is not taken by another worker
    while this one is alive.  SIGINT/SIGTERM (when run in the main thread)
    stop the claiming; tasks already running finish first.
    """

    def __init__(
        self,
        queue: TaskQueue,
        *,
        concurrency: int = 1,
        queues: Sequence[str] | None = None,
        burst: bool = False,
        poll_interval: float = 1.0,
        worker_id: str | None = None,
    ) -> None:
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        if poll_interval <= 0:
            raise ValueError(f"poll_interval must be positive, got {poll_interval!r}")
        self.queue = queue
        self.concurrency = concurrency
        self.queues = list(queues) if queues is not None else None
        self.burst = burst
        self.poll_interval = poll_interval
        self.worker_id = worker_id or queue.default_worker_id()
        self.processed = 0
        self.failed = 0
        self._counts_lock = threading.Lock()
        self._stopping = threading.Event()
        self._running: dict[Future[None], ClaimedTask] = {}
        self._running_lock = threading.Lock()

    def stop(self) -> None:
        """Stop claiming; `run` returns once the running tasks have finished."""
        self._stopping.set()

    def run(self) -> None:
        restore = self._install_signal_handlers()
        heartbeat = threading.Thread(target=self._heartbeat, name="sa_taskqueue-heartbeat", daemon=True)
        heartbeat.start()
        logger.info(
            "worker %s started: strategy=%s concurrency=%d queues=%s",
            self.worker_id,
            self.queue.strategy.name,
            self.concurrency,
            ",".join(self.queues) if self.queues is not None else "*",
        )
        try:
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="sa_taskqueue-task") as pool:
                self._loop(pool)
        finally:
            self._stopping.set()
            heartbeat.join()
            restore()
            logger.info("worker %s stopped: %d done, %d failed", self.worker_id, self.processed, self.failed)

    def _loop(self, pool: ThreadPoolExecutor) -> None:
        error_backoff = 0.0
        while not self._stopping.is_set():
            free = self.concurrency - len(self._running)
            claimed: list[ClaimedTask] = []
            if free > 0:
                try:
                    claimed = self.queue.claim(limit=free, queues=self.queues, worker_id=self.worker_id)
                    error_backoff = 0.0
                except TRANSIENT_ERRORS as error:
                    # A lost connection, a deadlock victim, a lock wait that
                    # timed out, an exhausted pool: try again, more slowly.
                    error_backoff = min(max(error_backoff * 2, 0.5), MAX_ERROR_BACKOFF)
                    logger.error("claim failed, retrying in %.1fs: %s", error_backoff, error)
                    self._stopping.wait(error_backoff)
                    continue
                for task in claimed:
                    future = pool.submit(self._execute, task)
                    with self._running_lock:
                        self._running[future] = task
            if not claimed and not self._running and self.burst:
                return
            if self._running and (free == 0 or claimed):
                # Busy: wait for a slot (or, having just claimed, loop to fill the rest).
                timeout = None if free == 0 or len(claimed) == free else 0
                done, _ = wait(list(self._running), timeout=timeout, return_when=FIRST_COMPLETED)
                self._reap(done)
            elif self._running:
                done, _ = wait(list(self._running), timeout=self.poll_interval, return_when=FIRST_COMPLETED)
                self._reap(done)
            elif not claimed:
                self._stopping.wait(self.poll_interval)
        # Stopping: let what runs finish.
        done, _ = wait(list(self._running))
        self._reap(done)

    def _reap(self, done: set[Future[None]]) -> None:
        with self._running_lock:
            for future in done:
                self._running.pop(future, None)

    def _execute(self, task: ClaimedTask) -> None:
        registered = self.queue.registered(task.name)
        started = time.perf_counter()
        try:
            if registered is None:
                # Only registered functions run: a row's name is never imported.
                raise TaskNotRegistered(task.name)
            logger.info("task %d %s attempt %d started", task.id, task.name, task.attempts)
            result = registered.func(**task.params)
        except BaseException as error:  # noqa: BLE001 - a task's failure is data, whatever it is
            with self._counts_lock:
                self.failed += 1
            logger.warning(
                "task %d %s attempt %d failed after %.3fs: %r",
                task.id,
                task.name,
                task.attempts,
                time.perf_counter() - started,
                error,
            )
            self._record(self.queue.fail, task, error)
            return
        with self._counts_lock:
            self.processed += 1
        logger.info(
            "task %d %s attempt %d done in %.3fs",
            task.id,
            task.name,
            task.attempts,
            time.perf_counter() - started,
        )
        self._record(self.queue.complete, task, result)

    def _record(self, outcome: Any, task: ClaimedTask, value: Any) -> None:
        try:
            recorded = outcome(task, value)
        except TRANSIENT_ERRORS as error:
            # The lease runs out and the task is claimed again: at least once.
            logger.error("task %d %s: could not record the outcome: %s", task.id, task.name, error)
            return
        except Exception as error:
            if outcome == self.queue.fail:
                logger.exception("task %d %s: could not record the failure", task.id, task.name)
                return
            logger.warning("task %d %s: its result cannot be stored: %s", task.id, task.name, error)
            self._record(self.queue.fail, task, error)
            return
        if not recorded:
            logger.warning(
                "task %d %s: outcome not recorded, the lease was lost to another worker", task.id, task.name
            )

    def _heartbeat(self) -> None:
        interval = self.queue.lease.total_seconds() / 3
        while not self._stopping.wait(interval):
            with self._running_lock:
                tasks = list(self._running.values())
            if not tasks:
                continue
            try:
                renewed = self.queue.extend_leases(tasks)
            except Exception as error:  # noqa: BLE001 - the heartbeat must outlive a bad moment
                logger.error("lease renewal failed: %s", error)
                continue
            lost = {task.id for task in tasks} - renewed
            if lost:
                logger.warning("lost the lease of task(s) %s", sorted(lost))

    def _install_signal_handlers(self) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def on_signal(signum: int, _frame: FrameType | None) -> None:
            if self._stopping.is_set():
                raise KeyboardInterrupt
            logger.info("received %s: finishing running tasks, claiming no more", signal.Signals(signum).name)
            self._stopping.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}

        def restore() -> None:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore
