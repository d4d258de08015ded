"""``sa_taskqueue.flask``: the Flask integration, at home in `sa_taskqueue.integrations.flask`."""

from sa_taskqueue.integrations.flask import (
    TaskQueueExtension,
    extension_of,
)

__all__ = [
    "TaskQueueExtension",
    "extension_of",
]
