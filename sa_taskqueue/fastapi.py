"""``sa_taskqueue.fastapi``: the FastAPI integration, at home in `sa_taskqueue.integrations.fastapi`."""

from sa_taskqueue.integrations.fastapi import (
    running_worker,
    session_dependency,
    worker_lifespan,
)

__all__ = [
    "running_worker",
    "session_dependency",
    "worker_lifespan",
]
