"""The optional behaviours: unique tasks, pauses, retention, periodic schedules, results, transactional tasks.

Each module owns its state, its SQL and its background service, and is
typed against the small protocols of `sa_taskqueue.core.ports`, never
against `TaskQueue` or `Worker`.
"""
