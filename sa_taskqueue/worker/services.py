"""The service runner, and the worker's own service: the LISTEN listener that wakes its claim loop.

`ServiceRunner` starts, supervises and stops any `Service`
(`sa_taskqueue.core.services`): one that raises is logged, emitted as a
SERVICE_ERROR event and restarted after a backoff, never taking the worker
down.  The features bring their own services (retention's deletions,
the schedule ticker); the worker runs them all the same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from sa_taskqueue.core.events import EventKind
from sa_taskqueue.core.notify import Listener
from sa_taskqueue.core.services import Service
from sa_taskqueue.worker.lifecycle import Emitter
from sa_taskqueue.worker.ports import WorkerQueue

logger = logging.getLogger("sa_taskqueue")

#: The first pause before a failed service runs again; doubled up to `MAX_RESTART_BACKOFF`.
MIN_RESTART_BACKOFF = 0.5
MAX_RESTART_BACKOFF = 30.0


class ServiceRunner:
    """Runs services in threads of their own, restarts those that raise, and stops them together."""

    def __init__(self, emit: Emitter) -> None:
        self._emit = emit
        self.stopping = threading.Event()
        self._services: list[tuple[Service, threading.Thread]] = []

    def start(self, services: Sequence[Service]) -> None:
        for service in services:
            thread = threading.Thread(
                target=self._supervise, args=(service,), name=f"sa_taskqueue-{service.name}", daemon=True
            )
            self._services.append((service, thread))
            thread.start()

    def _supervise(self, service: Service) -> None:
        backoff = MIN_RESTART_BACKOFF
        while not self.stopping.is_set():
            try:
                service.run(self.stopping)
                return
            except Exception as error:
                logger.exception("the %s service failed; restarting it in %.1fs", service.name, backoff)
                self._emit.worker(EventKind.SERVICE_ERROR, service=service.name, error=error)
            self.stopping.wait(backoff)
            backoff = min(backoff * 2, MAX_RESTART_BACKOFF)

    def interrupt(self) -> None:
        """Tell every service to stop, and interrupt a wait that would not see it at once."""
        self.stopping.set()
        for service, _thread in self._services:
            try:
                service.interrupt()
            except Exception:
                logger.exception("interrupting the %s service failed", service.name)

    def stop(self, timeout: float = 2.0) -> None:
        """`interrupt`, then wait for each service's thread up to ``timeout``."""
        if not self.stopping.is_set():
            self.interrupt()
        for _service, thread in self._services:
            thread.join(timeout=timeout)
        self._services = []


class ListenService:
    """Wakes the claim loop when a task is enqueued (NOTIFY at commit), and when a queue is paused or resumed.

    The listener is a thread of its own (`sa_taskqueue.core.notify.Listener`),
    this service's thread waits for it; a stop interrupts its wait.
    """

    name = "listen"

    def __init__(
        self,
        queue: WorkerQueue,
        notified: Callable[[str], None],
        pause_changed: Callable[[str], None],
        cancelled: Callable[[str], None] | None = None,
    ) -> None:
        self.queue = queue
        self.cancelled = cancelled
        self.notified = notified
        self.pause_changed = pause_changed
        self.listener: Listener | None = None

    def run(self, stopping: threading.Event) -> None:
        listener = Listener(
            self.queue.engine, self.queue.table, self.notified, stopping, self.pause_changed, self.cancelled
        )
        self.listener = listener
        listener.start()
        if stopping.is_set():
            listener.interrupt()  # (a stop set before its wait began is seen at once anyway)
        listener.join()

    def interrupt(self) -> None:
        if self.listener is not None:
            self.listener.interrupt()  # rather than within its wait for a quiet second


__all__ = ["ListenService", "ServiceRunner"]
