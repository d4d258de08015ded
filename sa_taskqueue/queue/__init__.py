"""`TaskQueue`: the coordinator an application holds; enqueue, claim, finish, and the features around them."""

from sa_taskqueue.queue.task_queue import DEFAULT_LEASE, DEFAULT_MAX_RETRY_DELAY, TaskQueue

__all__ = ["DEFAULT_LEASE", "DEFAULT_MAX_RETRY_DELAY", "TaskQueue"]
