"""The test application as the command line's worker imports it: ``tests.cli_app:queue``.

Configured from the environment the test sets for the subprocess.
"""

from __future__ import annotations

import os
from datetime import timedelta

from sa_taskqueue.strategies import ClaimStrategy, SkipLockedStrategy, SpreadingOptions
from tests.app import make_engine, make_queue

#: "on" or "off": skip_locked with its spreading over a cluster's nodes turned on or off, whatever the
#: server says it is.
spreading = os.environ.get("SA_TASKQUEUE_TEST_SPREADING")
strategy: str | ClaimStrategy | None = os.environ.get("SA_TASKQUEUE_TEST_STRATEGY") or None
if spreading:
    strategy = SkipLockedStrategy(spreading=SpreadingOptions(enabled={"on": True, "off": False}[spreading]))

queue = make_queue(
    make_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"]),
    strategy,
    timedelta(seconds=float(os.environ.get("SA_TASKQUEUE_TEST_LEASE", "300"))),
)
