"""Claim strategies: how workers take tasks without two of them holding the same one.

``ClaimStrategy`` (``base``) is the contract the queue calls; ``registry``
picks one per database and server version.  One module per locking technique,
and one for what they share:

- ``skip_locked``: ``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MySQL 8.0.1+, MariaDB 10.6+, Oracle)
- ``conditional``: an atomic conditional UPDATE (SQLite, older MySQL/MariaDB, any other database)
- ``advisory``: advisory locks held for the task's run (PostgreSQL, MySQL/MariaDB; chosen explicitly)
- ``claiming``: the due-rows query and what a claim writes and reads back
- ``lease``: the fenced writes out of RUNNING and lease recovery
- ``spreading``: skip_locked's claim on a multi-primary cluster, each node's workers on their own share
"""

from __future__ import annotations

from sa_taskqueue.strategies import registry
from sa_taskqueue.strategies.advisory import AdvisoryLockStrategy
from sa_taskqueue.strategies.base import ClaimStrategy
from sa_taskqueue.strategies.claiming import ClaimRequest
from sa_taskqueue.strategies.conditional import ConditionalUpdateStrategy
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy
from sa_taskqueue.strategies.spreading import SpreadingOptions

__all__ = [
    "AdvisoryLockStrategy",
    "ClaimRequest",
    "ClaimStrategy",
    "ConditionalUpdateStrategy",
    "SkipLockedStrategy",
    "SpreadingOptions",
    "registry",
]
