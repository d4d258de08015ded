"""What ``list`` and ``show`` print: no secret of the URL given, a listing bounded, one task whole.

A row stored before the queue scrubbed its errors may hold the password of
the URL the command is given, in its last error, its params or its result;
none of it is printed.  A listing is bounded whatever the rows hold: each
long value is cut around a marker saying how much was cut, and the row names
the columns cut; ``show`` (and ``list --json --full``) print values whole.

Also here: ``--url`` typed before the command, and ``--log-level`` in any case.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import quote

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from sa_taskqueue.cli.render import CUT_KEY, LISTED_VALUE_LENGTH
from tests.backends import Backend
from tests.helpers import run_cli, task_rows
from tests.test_stored_secrets import (
    SECRET,
    pytest_generate_tests,  # noqa: F401 - the ``where`` parameter, per backend, as there
    secret_url,
)

Run = Callable[..., Result]


@pytest.fixture
def run() -> Run:
    """``sa-taskqueue ARGS`` in this process, with ``url`` as $SA_TASKQUEUE_DATABASE_URL (None: unset)."""
    runner = CliRunner()

    def invoke(*args: str, url: str | None) -> Result:
        return runner.invoke(
            cli, list(args), env={"SA_TASKQUEUE_DATABASE_URL": url, "COLUMNS": "200"}, catch_exceptions=False
        )

    return invoke


def add_task(engine: sa.Engine, **values: object) -> int:
    """A finished task written straight into the table, as an older release (or anyone) may have left it."""
    with Session(engine) as session:
        task = tq.Task(name="reach", queue="default", status=tq.TaskStatus.FAILED, **values)
        session.add(task)
        session.commit()
        return task.id


# Secrets ----------------------------------------------------------------------------


def test_show_and_list_print_an_old_row_without_the_secrets_of_the_url_given(
    backend: Backend, engine: sa.Engine, run: Run, where: str
) -> None:
    url = secret_url(backend, where).render_as_string(hide_password=False)
    task_id = add_task(
        engine,
        params={"dsn": url, "note": f"login {SECRET}"},
        result={"token": SECRET},
        last_error=f"Traceback ...\nRuntimeError: could not reach {url}; the login with {SECRET} was refused",
    )
    for args in (
        ("show", str(task_id)),
        ("show", str(task_id), "--json"),
        ("list",),
        ("list", "--json"),
        ("list", "--json", "--full"),
    ):
        result = run(*args, url=url)
        assert result.exit_code == 0, result.output
        for form in (SECRET, quote(SECRET, safe=""), "s3cr@t", "Stored-Pw9"):
            assert form not in result.output, f"{args}: {form!r} was printed:\n{result.output}"
        if args[0] == "show" or "--json" in args:
            assert "***" in result.output, result.output
            assert "could not reach" in result.output, "the rest of the error is printed"


# A bounded listing ------------------------------------------------------------------

BIG_RESULT = {"blob": "r" * 2_000_000}
BIG_PARAMS = {"items": list(range(30_000))}
BIG_ERROR = "Traceback (most recent call last):\n" + "  frame\n" * 100_000 + "ValueError: the last line"


def test_list_cuts_each_long_value_and_says_how_much_it_cut(
    backend: Backend, engine: sa.Engine, run: Run
) -> None:
    ids = [add_task(engine, params=BIG_PARAMS, result=BIG_RESULT, last_error=BIG_ERROR) for _ in range(3)]
    listed = run("list", "--json", url=backend.url)
    assert listed.exit_code == 0, listed.output
    # Three rows of three long values each, cut to about LISTED_VALUE_LENGTH characters apiece.
    assert len(listed.output) < 3 * (3 * (LISTED_VALUE_LENGTH + 200) + 1000), len(listed.output)
    rows = json.loads(listed.output)
    assert [row["id"] for row in rows] == sorted(ids, reverse=True)
    for row in rows:
        whole = {
            "params": len(json.dumps(BIG_PARAMS)),
            "result": len(json.dumps(BIG_RESULT)),
            "last_error": len(BIG_ERROR),
        }
        assert row[CUT_KEY] == whole
        for column, length in whole.items():
            value = row[column]
            assert isinstance(value, str)
            assert f"{length - LISTED_VALUE_LENGTH:,} of {length:,} characters cut" in value, value
            assert f"sa-taskqueue show {row['id']}" in value
        assert row["params"].startswith('{"items": [0, 1, 2'), "the head of a cut value is kept"
        assert row["last_error"].endswith("ValueError: the last line"), "and its tail"
        assert row["name"] == "reach" and CUT_KEY not in row["name"], "short values are untouched"

    table = run("list", url=backend.url)
    assert table.exit_code == 0, table.output
    assert len(table.output) < 5000, "the table prints short columns only"


def test_show_and_list_full_print_a_long_value_whole(backend: Backend, engine: sa.Engine, run: Run) -> None:
    task_id = add_task(engine, params=BIG_PARAMS, result=BIG_RESULT, last_error=BIG_ERROR)
    small_id = add_task(engine, params={"a": 1}, result=2, last_error="short")
    shown = run("show", str(task_id), "--json", url=backend.url)
    assert shown.exit_code == 0, shown.output[-2000:]
    row = json.loads(shown.output)
    assert (row["params"], row["result"], row["last_error"]) == (BIG_PARAMS, BIG_RESULT, BIG_ERROR)
    assert CUT_KEY not in row
    plain = run("show", str(task_id), url=backend.url)
    assert plain.exit_code == 0
    assert BIG_ERROR in plain.output and BIG_RESULT["blob"] in plain.output
    full = run("list", "--json", "--full", url=backend.url)
    assert full.exit_code == 0
    small, big = json.loads(full.output)  # (newest first)
    assert (big["id"], big["result"], big["last_error"]) == (task_id, BIG_RESULT, BIG_ERROR)
    assert CUT_KEY not in big
    cut = json.loads(run("list", "--json", url=backend.url).output)
    assert cut[0] == small and small["id"] == small_id, "a row with nothing long is printed as before"
    refused = run("list", "--full", url=backend.url)
    assert refused.exit_code == 2 and "--full goes with --json" in refused.output


# --url before the command, --log-level in any case ---------------------------------


def test_url_is_taken_before_the_command_too(backend: Backend, engine: sa.Engine, run: Run) -> None:
    enqueued = run("--url", backend.url, "enqueue", "x", url=None)
    assert enqueued.exit_code == 0, enqueued.output
    assert [task.name for task in task_rows(engine)] == ["x"]
    status = run("--url", backend.url, "status", url=None)
    assert status.exit_code == 0, status.output
    assert "default" in status.output
    same = run("--url", backend.url, "list", "--url", backend.url, url=None)
    assert same.exit_code == 0, same.output
    # Over the environment's URL, as a --url after the command is.
    over_env = run("--url", backend.url, "list", "--json", url="sqlite:////nonexistent/nothing.db")
    assert over_env.exit_code == 0, over_env.output
    assert [row["name"] for row in json.loads(over_env.output)] == ["x"]


def test_two_different_urls_around_the_command_are_refused(backend: Backend, run: Run) -> None:
    other = sa.make_url(backend.url).set(database="elsewhere").render_as_string(hide_password=False)
    result = run("--url", backend.url, "purge", "--failed", "--older-than", "1d", "--url", other, url=None)
    assert result.exit_code == 2
    assert "--url is given before the command and after it, with different URLs" in result.output
    worker = run("--url", backend.url, "worker", "tests.cli_app:queue", url=None)
    assert worker.exit_code == 2
    assert "worker takes no --url" in worker.output


@pytest.mark.slow  # a real worker process
def test_log_level_is_taken_in_any_case(backend: Backend, engine: sa.Engine) -> None:
    assert run_cli("enqueue", "record", "--params", '{"key": 1}', url=backend.url).returncode == 0
    loud = run_cli("worker", "tests.cli_app:queue", "--burst", "--log-level", "DEBUG", url=backend.url)
    assert loud.returncode == 0, loud.stderr
    assert " DEBUG " in loud.stderr, loud.stderr
    quiet = run_cli("worker", "tests.cli_app:queue", "--burst", "--log-level", "Warning", url=backend.url)
    assert quiet.returncode == 0, quiet.stderr
    assert " INFO " not in quiet.stderr, quiet.stderr
