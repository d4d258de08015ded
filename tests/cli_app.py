"""The test application as the command line's worker imports it: ``tests.cli_app:queue``.

Configured from the environment the test sets for the subprocess.
"""

from __future__ import annotations

import os
from datetime import timedelta

from tests.app import make_engine, make_queue

queue = make_queue(
    make_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"]),
    os.environ.get("SA_TASKQUEUE_TEST_STRATEGY") or None,
    timedelta(seconds=float(os.environ.get("SA_TASKQUEUE_TEST_LEASE", "300"))),
)
