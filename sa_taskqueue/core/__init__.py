"""What every layer shares: the task row, its types and limits, validation, errors, events, notifications.

Nothing here knows of strategies, features, the worker or the queue; what
one database does differently is asked of its backend (`sa_taskqueue.backends`).
"""
