"""`SlotThreads`: the threads a worker's task slots run on.

A worker hands each task it claims to a thread, one per slot.  With a
`ThreadPoolExecutor` each hand-off builds a `Future` (a condition variable
made, notified and read back), a work item and a done callback, and pays for
the executor's idle-thread accounting: three times what the hand-off itself
costs for a task that does little, measured on every task a worker runs.
Here a task is one item on a queue that idle threads wait on, and each
thread runs it with what the worker needs around it (`run`).

A thread starts for each of the first tasks, up to one per slot.  Like an
executor's threads they are not daemon threads: an interpreter exiting
waits for a task still running in one.  An idle thread ends at once once
`shutdown` is called, and within `IDLE_CHECK` seconds of the main thread's
end otherwise; from then on a task is refused, as an executor refuses one
while the interpreter exits, so none is queued for threads that are gone.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger("sa_taskqueue")

#: How often an idle thread looks whether the interpreter is exiting (seconds).
IDLE_CHECK = 1.0

T = TypeVar("T")

_SHUTDOWN = object()


class SlotThreads(Generic[T]):
    """Up to ``count`` threads running ``run(item)`` for each item submitted, in the order submitted.

    ``unstarted`` is called, in `shutdown`, for each item no thread had taken
    up.  ``run`` handles its item's errors: one it lets out is logged, and
    its thread goes on to the next item.
    """

    def __init__(
        self, count: int, run: Callable[[T], None], unstarted: Callable[[T], None], *, name: str
    ) -> None:
        if count < 1:
            raise ValueError(f"the number of slot threads must be positive, got {count!r}")
        self._count = count
        self._run = run
        self._unstarted = unstarted
        self._name = name
        self._items: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()
        self._main = threading.main_thread()

    def submit(self, item: T) -> None:
        """Queue ``item`` for the next idle thread, starting one for each of the first ``count`` items.

        `RuntimeError` once shut down, or once the main thread has ended (the
        interpreter is exiting), as an executor refuses new work then: the
        idle threads end with the main thread, and an item queued after them
        would never run.
        """
        if self._closed or not self._main.is_alive():
            raise RuntimeError("the slot threads are shut down, or the interpreter is exiting")
        if len(self._threads) < self._count:
            with self._lock:
                if len(self._threads) < self._count:
                    thread = threading.Thread(
                        target=self._serve, name=f"{self._name}_{len(self._threads)}", daemon=False
                    )
                    thread.start()
                    self._threads.append(thread)
        self._items.put(item)

    def shutdown(self) -> None:
        """Take no more items; hand those not taken up to ``unstarted``; each thread ends after its item.

        Returns at once: a thread still running its item runs on.
        """
        with self._lock:
            self._closed = True
            threads = len(self._threads)
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is _SHUTDOWN:
                continue
            try:
                self._unstarted(item)  # type: ignore[arg-type]
            except Exception:
                logger.exception("a task no slot thread took up could not be handed back")
        for _ in range(threads):
            self._items.put(_SHUTDOWN)

    @property
    def threads(self) -> list[threading.Thread]:
        """The threads started so far (for tests and diagnostics)."""
        return list(self._threads)

    def _serve(self) -> None:
        while True:
            try:
                item = self._items.get(timeout=IDLE_CHECK)
            except queue.Empty:
                if self._closed or not self._main.is_alive():
                    return
                continue
            if item is _SHUTDOWN:
                return
            try:
                self._run(item)  # type: ignore[arg-type]
            except BaseException as error:  # noqa: BLE001 - the thread serves the next slot all the same
                logger.error("a task slot ended with an error: %r", error)
            del item  # (an idle thread keeps no task alive)


__all__ = ["IDLE_CHECK", "SlotThreads"]
