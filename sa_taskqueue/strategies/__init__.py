"""Claim strategies: how workers take tasks without two of them holding the same one.

``ClaimStrategy`` is the contract the queue calls; ``registry`` picks one per
dialect and server version.  One module per locking technique:

- ``skip_locked``: ``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MySQL 8.0.1+, MariaDB 10.6+, Oracle)
- ``conditional``: an atomic conditional UPDATE (SQLite, older MySQL/MariaDB)
- ``advisory``: advisory locks held for the task's run (PostgreSQL, MySQL/MariaDB; chosen explicitly)
"""

from __future__ import annotations

from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.advisory import AdvisoryLockStrategy
from sa_taskqueue.strategies.base import ClaimRequest, ClaimStrategy
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy

__all__ = [
    "AdvisoryLockStrategy",
    "ClaimRequest",
    "ClaimStrategy",
    "ConditionalUpdateStrategy",
    "SkipLockedStrategy",
    "registry",
]
