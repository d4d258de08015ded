"""``sa-taskqueue status APP``: what the workers of APP will leave queued because APP does not register it.

During a rolling deploy a newer release may enqueue tasks that the workers
still running do not know; they leave those rows queued.  Given the
application its workers load, ``status`` names each such task, with how many
are queued and how long the oldest has waited.  Without an application it
cannot know what is registered, and says nothing about it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # real processes

APP = "tests.cli_app:queue"  # registers "record", "hang", "boom", ...


def add_queued(engine: sa.Engine, name: str, count: int, enqueued_ago: timedelta) -> None:
    created = datetime.now(UTC) - enqueued_ago
    with Session(engine) as session:
        session.add_all(tq.Task(name=name, created_at=created, run_at=created) for _ in range(count))
        session.commit()


def test_status_with_the_app_names_queued_tasks_it_does_not_register(
    backend: Backend, engine: sa.Engine
) -> None:
    add_queued(engine, "record", 2, timedelta(days=5))  # registered: not listed, however old
    add_queued(engine, "reports.v2", 3, timedelta(hours=2))
    add_queued(engine, "billing.v3", 1, timedelta(days=3))
    with Session(engine) as session:  # not queued: nothing for a worker to leave behind
        session.add(tq.Task(name="gone.v0", status=tq.TaskStatus.FAILED, attempts=3))
        session.commit()
    # The database is APP's own, or the one --url names on the command line.
    for args in (("status", APP), ("status", APP, "--url", backend.url)):
        result = run_cli(*args, url=backend.url)
        assert result.returncode == 0, result.stderr
        [line] = [line for line in result.stdout.splitlines() if line.startswith("not registered here:")]
        assert line == (
            "not registered here: "
            "billing.v3 (1 queued, oldest 3.0d ago); reports.v2 (3 queued, oldest 2.0h ago)"
        )


def test_status_with_the_app_says_when_every_queued_name_is_registered(
    backend: Backend, engine: sa.Engine
) -> None:
    add_queued(engine, "record", 1, timedelta(minutes=1))
    result = run_cli("status", APP, url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "not registered here: none" in result.stdout


def test_status_without_an_app_says_nothing_about_registration(backend: Backend, engine: sa.Engine) -> None:
    add_queued(engine, "reports.v2", 3, timedelta(hours=2))
    result = run_cli("status", url=backend.url)
    assert result.returncode == 0, result.stderr
    assert "registered" not in result.stdout
    # What no live worker serves (none runs here) is said with or without APP.
    [line] = [line for line in result.stdout.splitlines() if "reports.v2" in line]
    assert line == "no live worker serves: reports.v2 on queue default (3 due, oldest 2.0h)"


def test_status_with_an_app_that_does_not_load_is_one_line(backend: Backend) -> None:
    result = run_cli("status", "no_such_module_here:queue", url=backend.url)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == "error: cannot import 'no_such_module_here': No module named 'no_such_module_here'"
    )
