"""The worker: claim, run, record, renew leases, shut down cleanly.  No SQL of its own."""

from sa_taskqueue.worker.worker import (
    CLOSE_TIMEOUT,
    DEFAULT_COMPLETION_DELAY,
    MAX_ERROR_BACKOFF,
    MIN_POLL_INTERVAL,
    Worker,
    heartbeat_interval,
)

__all__ = [
    "CLOSE_TIMEOUT",
    "DEFAULT_COMPLETION_DELAY",
    "MAX_ERROR_BACKOFF",
    "MIN_POLL_INTERVAL",
    "Worker",
    "heartbeat_interval",
]
