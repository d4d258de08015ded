"""A test application with a task table of its own: ``tests.cli_own_table_app:queue``.

The command line's ``--app`` (and ``worker``) load it.

Its database is $SA_TASKQUEUE_DATABASE_URL, read when it is first imported.
"""

from __future__ import annotations

import os

import sqlalchemy as sa

import sa_taskqueue as tq
from tests.own_table import Job, register

queue = register(tq.TaskQueue(sa.create_engine(os.environ["SA_TASKQUEUE_DATABASE_URL"]), model=Job))
