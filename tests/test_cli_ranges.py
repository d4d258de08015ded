"""Every number the command line takes is checked against its range where it is typed.

A value out of range is a usage error (exit code 2) in one line naming the
option and the range allowed, never a traceback from deep inside a driver;
the ends of each range are accepted and work on every database.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.backends import Backend
from tests.helpers import run_cli, task_rows

pytestmark = pytest.mark.slow  # real processes

INT32 = "between -2147483648 and 2147483647"
ATTEMPTS = "between 1 and 2147483647"
TASK_ID = "between 1 and 9223372036854775807"
DURATION = "between 0s and 36500d"
WAIT = "between 0 and 86400 seconds"
POLL = "between 0.001 and 86400 seconds"


@pytest.mark.backends("sqlite")  # refused before any database is used
@pytest.mark.parametrize(
    ("args", "option", "allowed"),
    [
        (("enqueue", "x", "--priority", "2147483648"), "--priority", INT32),
        (("enqueue", "x", "--priority", "-2147483649"), "--priority", INT32),
        (("enqueue", "x", "--priority", "1e20"), "--priority", INT32),
        (("enqueue", "x", "--max-attempts", "0"), "--max-attempts", ATTEMPTS),
        (("enqueue", "x", "--max-attempts", "2147483648"), "--max-attempts", ATTEMPTS),
        (("enqueue", "x", "--delay", "9999999999d"), "--delay", DURATION),
        (("enqueue", "x", "--delay", "36501d"), "--delay", DURATION),
        (("enqueue", "x", "--delay", "9" * 400), "--delay", DURATION),
        (("purge", "--completed", "--older-than", "99999999d"), "--older-than", DURATION),
        (
            ("purge", "--completed", "--older-than", "1d", "--batch-size", "0"),
            "--batch-size",
            "between 1 and 10000",
        ),
        (
            ("purge", "--completed", "--older-than", "1d", "--batch-size", "10001"),
            "--batch-size",
            "and 10000",
        ),
        (("retry", "99999999999999999999"), "TASK_ID", TASK_ID),
        (("retry", "0"), "TASK_ID", TASK_ID),
        (("cancel", "99999999999999999999"), "TASK_ID", TASK_ID),
        (("cancel", "9223372036854775808"), "TASK_ID", TASK_ID),
        (("worker", "tests.cli_app:queue", "--concurrency", "0"), "--concurrency", "between 1 and 1000"),
        (("worker", "tests.cli_app:queue", "--concurrency", "10**9"), "--concurrency", "between 1 and 1000"),
        (("worker", "tests.cli_app:queue", "--poll-interval", "1e300"), "--poll-interval", POLL),
        (("worker", "tests.cli_app:queue", "--poll-interval", "nan"), "--poll-interval", POLL),
        (("worker", "tests.cli_app:queue", "--poll-interval", "inf"), "--poll-interval", POLL),
        (("worker", "tests.cli_app:queue", "--poll-interval", "0"), "--poll-interval", POLL),
        (("worker", "tests.cli_app:queue", "--shutdown-timeout", "-1"), "--shutdown-timeout", WAIT),
        (("worker", "tests.cli_app:queue", "--shutdown-timeout", "1e300"), "--shutdown-timeout", WAIT),
        (("demo", "--tasks", "0"), "--tasks", "between 1 and 1000000"),
        (("demo", "--tasks", "99999999999999999999"), "--tasks", "between 1 and 1000000"),
        (("demo", "--workers", "65"), "--workers", "between 1 and 64"),
    ],
)
def test_a_number_out_of_range_is_a_usage_error_naming_the_option_and_the_range(
    backend: Backend, args: tuple[str, ...], option: str, allowed: str
) -> None:
    result = run_cli(*args, url=backend.url)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert "Invalid value for" in error and option in error, error
    assert allowed in error, error


def test_the_ends_of_each_range_are_accepted_and_stored(backend: Backend, engine: sa.Engine) -> None:
    for priority, delay in (("2147483647", "36500d"), ("-2147483648", "0s")):
        result = run_cli(
            "enqueue",
            "x",
            "--priority",
            priority,
            "--max-attempts",
            "2147483647",
            "--delay",
            delay,
            url=backend.url,
        )
        assert result.returncode == 0, result.stderr
    highest, lowest = task_rows(engine)
    assert (highest.priority, highest.max_attempts) == (2**31 - 1, 2**31 - 1)
    assert highest.run_at - datetime.now(UTC) > timedelta(days=36499)
    assert lowest.priority == -(2**31)


def test_the_largest_task_id_is_looked_up_not_overflowed(backend: Backend, engine: sa.Engine) -> None:
    largest = str(2**63 - 1)
    for command, says in (("retry", "not failed or cancelled"), ("cancel", f"task {largest} does not exist")):
        result = run_cli(command, largest, url=backend.url)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert says in result.stderr


def test_purging_a_century_back_deletes_only_what_is_older(backend: Backend, engine: sa.Engine) -> None:
    with Session(engine) as session:
        session.add(
            tq.Task(name="d", status=tq.TaskStatus.COMPLETED, attempts=1, finished_at=datetime.now(UTC))
        )
        session.commit()
    result = run_cli(
        "purge", "--completed", "--older-than", "36500d", "--batch-size", "10000", url=backend.url
    )
    assert result.returncode == 0, result.stderr
    assert "deleted 0 task(s)" in result.stdout
    assert len(task_rows(engine)) == 1
