"""The admin commands on an application's own task table, named with ``--app MODULE:QUEUE``.

An application that maps `TaskMixin` on its own Base keeps its tasks in a
table of its own: every admin command given ``--app`` must read and write
that table, on the application's database, and leave the library's own
``sa_taskqueue_task`` alone.  Run in-process with click's runner against the
live database.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from tests.backends import Backend
from tests.helpers import run_cli, task_rows
from tests.own_table import Job, JobBase

APP = (
    "tests.cli_own_table_app:queue"  # registers mail.send (queue mail, priority 5, 7 attempts), report.build
)
JOBS = Job.__table__


@pytest.fixture
def jobs(engine: sa.Engine) -> sa.Engine:
    """The application's own table, created once and emptied for each test."""
    JobBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(JOBS.delete())
    return engine


@pytest.fixture
def run(backend: Backend) -> Callable[..., Result]:
    """``sa-taskqueue ARGS`` in this process; a wide terminal, so that no table cell wraps."""
    runner = CliRunner()

    def invoke(*args: str, stdin: str | None = None) -> Result:
        return runner.invoke(
            cli,
            list(args),
            input=stdin,
            env={"SA_TASKQUEUE_DATABASE_URL": backend.url, "COLUMNS": "200"},
            catch_exceptions=False,
        )

    return invoke


def job_rows(engine: sa.Engine) -> list[Job]:
    with Session(engine) as session:
        rows = list(session.scalars(sa.select(Job).order_by(Job.id)))
        session.expunge_all()
        return rows


def add_jobs(engine: sa.Engine, *jobs: Job) -> list[int]:
    with Session(engine) as session:
        session.add_all(jobs)
        session.commit()
        return [job.id for job in jobs]


# enqueue ----------------------------------------------------------------------------


def test_enqueue_with_app_writes_its_table_with_the_task_s_own_defaults(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run("enqueue", "mail.send", "--params", '{"to": "a@example.com"}', "--app", APP)
    assert result.exit_code == 0, result.output
    [job] = job_rows(jobs)
    assert (job.name, job.queue, job.priority, job.max_attempts, job.params) == (
        "mail.send",
        "mail",
        5,
        7,
        {"to": "a@example.com"},
    )
    assert f"enqueued task {job.id} (mail.send) on queue mail, priority 5, max attempts 7" in result.output
    assert task_rows(jobs) == [], "the library's own table is not the application's"


def test_enqueue_options_given_override_the_task_s_defaults(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run(
        "enqueue", "mail.send", "--params", '{"to": "b"}', "--app", APP,
        "--queue", "urgent", "--priority", "-3", "--max-attempts", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    [job] = job_rows(jobs)
    assert (job.queue, job.priority, job.max_attempts) == ("urgent", -3, 2)


def test_enqueue_with_url_alone_keeps_the_library_defaults(
    backend: Backend, jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run("enqueue", "mail.send", "--params", '{"to": "c"}', "--url", backend.url)
    assert result.exit_code == 0, result.output
    [task] = task_rows(jobs)
    assert (task.queue, task.priority, task.max_attempts) == ("default", 0, 3)
    assert "on queue default, priority 0, max attempts 3" in result.output
    assert job_rows(jobs) == []
    help_text = run("enqueue", "--help").output
    assert "the task's own with --app, else 3" in " ".join(help_text.split())


def test_enqueue_with_app_checks_params_against_the_function(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run("enqueue", "mail.send", "--params", '{"subject": "no recipient"}', "--app", APP)
    assert result.exit_code == 1
    assert "params do not fit task 'mail.send'" in result.output
    assert job_rows(jobs) == []


def test_enqueue_of_a_name_the_app_does_not_register_says_so_and_uses_the_defaults(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run("enqueue", "reports.v2", "--app", APP)
    assert result.exit_code == 0, result.output
    assert f"note: {APP} registers no task 'reports.v2'" in result.stderr
    [job] = job_rows(jobs)
    assert (job.queue, job.priority, job.max_attempts) == ("default", 0, 3)


def test_enqueue_reads_params_from_a_file_and_from_stdin(
    jobs: sa.Engine, run: Callable[..., Result], tmp_path: Path
) -> None:
    params = tmp_path / "params.json"
    params.write_text('{"to": "file@example.com", "subject": "hi"}', encoding="utf-8")
    assert run("enqueue", "mail.send", "--app", APP, "--params", f"@{params}").exit_code == 0
    piped = run("enqueue", "mail.send", "--app", APP, "--params", "-", stdin='{"to": "stdin@example.com"}')
    assert piped.exit_code == 0, piped.output
    assert [job.params for job in job_rows(jobs)] == [
        {"to": "file@example.com", "subject": "hi"},
        {"to": "stdin@example.com"},
    ]


@pytest.mark.parametrize(
    ("params", "stdin", "file_text", "message"),
    [
        ("@FILE", None, "{not json", "the file '{file}' is not JSON: Expecting property name"),
        ("@FILE", None, "[1, 2]", "the file '{file}' must be a JSON object"),
        ("@{missing}", None, None, "cannot read the file '{missing}': No such file or directory"),
        ("-", "not json", None, "stdin is not JSON: Expecting value"),
        ("-", '"a string"', None, "stdin must be a JSON object, like"),
        ("[1]", None, None, "the value must be a JSON object"),
    ],
)
def test_bad_params_are_a_usage_error_naming_the_problem_and_the_source(
    jobs: sa.Engine,
    run: Callable[..., Result],
    tmp_path: Path,
    params: str,
    stdin: str | None,
    file_text: str | None,
    message: str,
) -> None:
    file = tmp_path / "params.json"
    missing = tmp_path / "missing.json"
    if file_text is not None:
        file.write_text(file_text, encoding="utf-8")
    params = params.replace("FILE", str(file)).format(missing=missing)
    result = run("enqueue", "mail.send", "--app", APP, "--params", params, stdin=stdin)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--params'" in result.stderr
    assert message.format(file=file, missing=missing) in " ".join(result.stderr.split())
    assert job_rows(jobs) == []


def test_enqueue_run_at_takes_an_iso_time_with_its_offset(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    result = run("enqueue", "report.build", "--app", APP, "--params", '{"day": "x"}',
                 "--run-at", "2031-03-04T05:06:07+02:00")  # fmt: skip
    assert result.exit_code == 0, result.output
    [job] = job_rows(jobs)
    assert job.run_at == datetime(2031, 3, 4, 3, 6, 7, tzinfo=UTC)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--run-at", "2031-03-04T05:06:07"), "has no UTC offset"),
        (("--run-at", "next tuesday"), "is not an ISO 8601 date and time"),
        (("--run-at", "2031-01-01T00:00:00Z", "--delay", "5m"), "give --delay or --run-at, not both"),
    ],
)
def test_a_bad_run_at_is_a_usage_error(
    jobs: sa.Engine, run: Callable[..., Result], args: tuple[str, ...], message: str
) -> None:
    result = run("enqueue", "report.build", "--app", APP, "--params", '{"day": "x"}', *args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert job_rows(jobs) == []


# status, retry, cancel, purge ----------------------------------------------------------


def test_status_counts_the_app_s_table_given_as_argument_or_option(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    add_jobs(jobs, Job(name="mail.send", queue="mail"), Job(name="reports.v2", queue="reports"))
    for args in (("status", APP), ("status", "--app", APP)):
        result = run(*args)
        assert result.exit_code == 0, result.output
        assert "mail" in result.output
        assert "reports" in result.output
        assert "not registered here: reports.v2 (1 queued" in result.output


def test_status_with_both_app_forms_is_a_usage_error(jobs: sa.Engine, run: Callable[..., Result]) -> None:
    result = run("status", APP, "--app", APP)
    assert result.exit_code == 2
    assert "give APP or --app, not both" in result.stderr


def test_retry_cancel_and_purge_act_on_the_app_s_table(jobs: sa.Engine, run: Callable[..., Result]) -> None:
    long_ago = datetime.now(UTC) - timedelta(days=30)
    failed, queued, done = add_jobs(
        jobs,
        Job(name="report.build", status=tq.TaskStatus.FAILED, attempts=3, finished_at=long_ago),
        Job(name="mail.send"),
        Job(name="mail.send", status=tq.TaskStatus.COMPLETED, attempts=1, finished_at=long_ago),
    )
    # The same ids in the library's table must stay untouched.
    with Session(jobs) as session:
        session.add_all(
            [
                tq.Task(id=failed, name="x", status=tq.TaskStatus.FAILED, finished_at=long_ago),
                tq.Task(id=queued, name="x"),
                tq.Task(id=done, name="x", status=tq.TaskStatus.COMPLETED, finished_at=long_ago),
            ]
        )
        session.commit()
    assert run("retry", str(failed), "--app", APP).exit_code == 0
    assert run("cancel", str(queued), "--app", APP).exit_code == 0
    purged = run("purge", "--completed", "--older-than", "7d", "--app", APP)
    assert purged.exit_code == 0, purged.output
    assert "deleted 1 task(s)" in purged.output
    assert {job.id: (job.status, job.attempts) for job in job_rows(jobs)} == {
        failed: (tq.TaskStatus.QUEUED, 0),
        queued: (tq.TaskStatus.CANCELLED, 0),
    }
    assert [task.status for task in task_rows(jobs)] == [
        tq.TaskStatus.FAILED,
        tq.TaskStatus.QUEUED,
        tq.TaskStatus.COMPLETED,
    ]


def test_app_with_url_on_the_command_line_reads_the_app_s_table_there(
    backend: Backend, jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    [job_id] = add_jobs(jobs, Job(name="mail.send", queue="mail"))
    result = run("list", "--json", "--app", APP, "--url", backend.url)
    assert result.exit_code == 0, result.output
    assert [row["id"] for row in json.loads(result.stdout)] == [job_id]


# list and show ---------------------------------------------------------------------


def test_list_shows_the_newest_first_and_filters(jobs: sa.Engine, run: Callable[..., Result]) -> None:
    ids = add_jobs(
        jobs,
        Job(name="mail.send", queue="mail"),
        Job(name="report.build", status=tq.TaskStatus.FAILED, attempts=3, max_attempts=3),
        Job(name="mail.send", queue="mail", status=tq.TaskStatus.RUNNING, attempts=1, locked_by="host:1:ab"),
        Job(name="report.build"),
    )

    def listed(*args: str) -> list[dict[str, Any]]:
        result = run("list", "--json", "--app", APP, *args)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)  # type: ignore[no-any-return]

    assert [row["id"] for row in listed()] == ids[::-1]
    assert [row["id"] for row in listed("--status", "failed")] == [ids[1]]
    assert [row["id"] for row in listed("--queue", "mail")] == [ids[2], ids[0]]
    assert [row["id"] for row in listed("--name", "report.build", "--status", "queued")] == [ids[3]]
    assert [row["id"] for row in listed("--limit", "2")] == [ids[3], ids[2]]
    running = listed("--status", "running")[0]
    assert (running["attempts"], running["max_attempts"], running["locked_by"]) == (1, 3, "host:1:ab")
    assert datetime.fromisoformat(running["run_at"]).utcoffset() == timedelta(0)

    table = run("list", "--app", APP)
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert any("host:1:ab" in line and "1/3" in line and "running" in line for line in lines), table.output
    assert run("list", "--status", "nosuch", "--app", APP).exit_code == 2


def test_show_prints_every_column_and_the_traceback_verbatim(
    jobs: sa.Engine, run: Callable[..., Result]
) -> None:
    traceback_text = (
        "Traceback (most recent call last):\n"
        '  File "/srv/app/reports.py", line 12, in build\n'
        '    raise RuntimeError(f"no data for {day}")\n'
        "RuntimeError: no data for [bold]2026-01-01[/bold]"
    )
    lease_end = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    [job_id] = add_jobs(
        jobs,
        Job(
            name="report.build",
            params={"day": "2026-01-01", "tags": ["a", "b"]},
            status=tq.TaskStatus.RUNNING,
            attempts=2,
            max_attempts=5,
            locked_by="web-1:4242:beef",
            locked_until=lease_end,
            started_at=lease_end - timedelta(minutes=5),
            last_error=traceback_text,
            result={"rows": 3},
        ),
    )
    shown = run("show", str(job_id), "--json", "--app", APP)
    assert shown.exit_code == 0, shown.output
    row = json.loads(shown.stdout)
    assert set(row) == {column.name for column in JOBS.columns}
    assert row["params"] == {"day": "2026-01-01", "tags": ["a", "b"]}
    assert row["last_error"] == traceback_text
    assert row["result"] == {"rows": 3}
    assert (row["locked_by"], datetime.fromisoformat(row["locked_until"])) == ("web-1:4242:beef", lease_end)

    text = run("show", str(job_id), "--app", APP)
    assert text.exit_code == 0, text.output
    assert traceback_text in text.output, "the traceback verbatim, no markup read into it"
    assert json.dumps({"day": "2026-01-01", "tags": ["a", "b"]}, indent=2) in text.output
    lines = text.output.splitlines()
    for label, value in (
        ("lease holder", "web-1:4242:beef"),
        ("lease ends", "2030-01-02 03:04:05+00:00"),
        ("attempts", "2"),
        ("max_attempts", "5"),
        ("status", "running"),
    ):
        assert any(label in line and value in line for line in lines), (label, text.output)


def test_show_an_unknown_id_is_a_clear_failure(jobs: sa.Engine, run: Callable[..., Result]) -> None:
    result = run("show", "987654", "--app", APP)
    assert result.exit_code == 1
    assert result.stderr.strip() == "error: no task 987654 in app_job"


# the worker's JSON log lines -----------------------------------------------------------


@pytest.mark.slow  # a worker process
def test_json_log_lines_carry_the_task_s_fields(backend: Backend, jobs: sa.Engine) -> None:
    ok, bad = add_jobs(
        jobs,
        Job(name="mail.send", queue="mail", params={"to": "a@example.com"}),
        Job(name="report.build", params={"day": "monday"}),
    )
    worker = run_cli("worker", APP, "--burst", "--log-format", "json", url=backend.url)
    assert worker.returncode == 0, worker.stderr
    entries = [json.loads(line) for line in worker.stderr.splitlines() if line.strip()]

    def about(task_id: int, ending: str) -> dict[str, Any]:
        [entry] = [e for e in entries if e.get("task_id") == task_id and ending in e["message"]]
        return entry  # type: ignore[no-any-return]

    started = about(ok, "started")
    assert {key: started[key] for key in ("level", "logger", "task_name", "queue", "attempt")} == {
        "level": "info",
        "logger": "sa_taskqueue",
        "task_name": "mail.send",
        "queue": "mail",
        "attempt": 1,
    }
    assert datetime.fromisoformat(started["time"]).utcoffset() == timedelta(0)
    assert started["worker_id"].count(":") == 2  # host:pid:token
    done = about(ok, "done in")
    assert done["duration_ms"] >= 0
    assert done["worker_id"] == started["worker_id"]
    assert "error" not in done
    failed = about(bad, "failed after")
    assert (failed["level"], failed["task_name"], failed["error"]) == (
        "warning",
        "report.build",
        "no data for monday",
    )
    assert failed["duration_ms"] >= 0
    assert {entry["logger"] for entry in entries} == {"sa_taskqueue"}
