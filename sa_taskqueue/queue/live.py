"""`TaskQueue.workers`: the live workers of the queue's table, for an application or a dashboard.

Kept apart from the queue's other methods; the work is done by the queue's
`LiveWorkers` part (`sa_taskqueue.features.live_workers`), which also gives
each worker the service that keeps it listed.
"""

from __future__ import annotations

from sa_taskqueue.features.live_workers import LiveWorker, LiveWorkers


class LiveWorkersListing:
    """`TaskQueue`'s live-worker listing (this class is not used on its own)."""

    #: The live-worker registry: what `workers` lists, and the service each worker runs to be listed.
    live_workers: LiveWorkers

    def workers(self) -> list[LiveWorker]:
        """The workers of this queue's table live now, oldest first, each with the tasks it runs.

        A worker is live from its start until it stops, or, if it dies
        without stopping (SIGKILL, a lost machine), until a few of its
        heartbeats have passed without one.  Read with the queue's clock.
        """
        return self.live_workers.live()


__all__ = ["LiveWorkersListing"]
