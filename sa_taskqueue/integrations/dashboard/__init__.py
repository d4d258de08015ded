"""The web dashboard: queues, tasks, workers, schedules and health, with the actions the command line has.

Install the ``dashboard`` extra (``pip install 'sa_taskqueue[dashboard]'``),
then run ``sa-taskqueue dashboard APP`` or mount `create_app` in a
Starlette or FastAPI application.  See docs/how-to/dashboard.md.
"""

from sa_taskqueue.integrations.dashboard.app import create_app

__all__ = ["create_app"]
