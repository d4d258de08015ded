"""The admin commands against an application whose only engine is async (``--app tests.async_cli_app:queue``).

Each command reaches the app's table through the app's own AsyncEngine, so
every call must run on that engine's event loop; the rows are read back with
the suite's sync engine, so what is checked is what the database holds.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import ASYNC_DRIVERS, Backend
from tests.helpers import run_cli, task_row, task_rows

# Every test here starts real processes.
pytestmark = [pytest.mark.slow, pytest.mark.async_path]

APP = "tests.async_cli_app:queue"


@pytest.fixture(scope="module")
def driver(request: pytest.FixtureRequest, backend: Backend) -> str:
    chosen: str | None = request.config.getoption("--async-driver")
    return chosen or ASYNC_DRIVERS[backend.name][0]


def cli(backend: Backend, driver: str, *args: str) -> str:
    """``sa-taskqueue ARGS --app APP`` to a successful end; its output."""
    done = run_cli(*args, "--app", APP, url=backend.url, SA_TASKQUEUE_TEST_ASYNC_DRIVER=driver)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_enqueue_status_list_and_show_reach_the_apps_table_through_its_async_engine(
    backend: Backend, driver: str, engine: sa.Engine
) -> None:
    out = cli(backend, driver, "enqueue", "double", "--params", '{"n": 21}', "--queue", "math")
    [task] = task_rows(engine)
    assert f"enqueued task {task.id} (double)" in out
    assert (task.name, task.queue, task.params) == ("double", "math", {"n": 21})

    assert "math" in cli(backend, driver, "status")
    [listed] = json.loads(cli(backend, driver, "list", "--json"))
    assert (listed["id"], listed["name"], listed["queue"]) == (task.id, "double", "math")
    shown = json.loads(cli(backend, driver, "show", str(task.id), "--json"))
    assert (shown["id"], shown["params"]) == (task.id, {"n": 21})


def test_cancel_retry_and_purge_change_the_apps_rows_through_its_async_engine(
    backend: Backend, driver: str, engine: sa.Engine
) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=30)
    with Session(engine) as session:
        queued = tq.Task(name="double", params={"n": 1})
        failed = tq.Task(name="double", params={"n": 2}, status=tq.TaskStatus.FAILED, finished_at=long_ago)
        completed = tq.Task(
            name="double", params={"n": 3}, status=tq.TaskStatus.COMPLETED, finished_at=long_ago
        )
        session.add_all([queued, failed, completed])
        session.commit()
        ids = queued.id, failed.id, completed.id

    assert f"cancelled task {ids[0]}" in cli(backend, driver, "cancel", str(ids[0]))
    assert task_row(engine, ids[0]).status == tq.TaskStatus.CANCELLED
    assert "queued 1 task(s) to run again" in cli(backend, driver, "retry", str(ids[1]))
    assert task_row(engine, ids[1]).status == tq.TaskStatus.QUEUED
    assert "deleted 1 task(s)" in cli(backend, driver, "purge", "--completed", "--older-than", "7d")
    assert sorted(t.id for t in task_rows(engine)) == sorted(ids[:2])
