"""The command line on every URL a user has: asyncio drivers, ``postgres://``, and ``migrate --app``.

Run in-process with click's runner against the live database.  An async
URL is driven through the driver it names (an `AsyncEngine` whose calls the
queue runs on its own loop), so nothing here needs a synchronous driver
besides the one the suite's own engine reads the rows back with.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner, Result
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from sa_taskqueue.core import migrate
from tests.backends import Backend
from tests.helpers import run_cli, task_row, task_rows

#: The asyncio dialects each backend is reached through here (the first part of the URL).
ASYNC_FORMS: dict[str, tuple[str, ...]] = {
    "sqlite": ("sqlite+aiosqlite",),
    "postgres": ("postgresql+asyncpg", "postgresql+psycopg_async"),
    "postgres18": ("postgresql+asyncpg", "postgresql+psycopg_async"),
    "mysql": ("mysql+aiomysql",),
    "mariadb": ("mariadb+aiomysql", "mysql+aiomysql"),
    "oracle": ("oracle+oracledb_async",),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "async_form" in metafunc.fixturenames:
        forms = ASYNC_FORMS[metafunc.config.getoption("--backend")]
        metafunc.parametrize("async_form", forms, ids=forms)


@pytest.fixture
def async_url(backend: Backend, async_form: str) -> str:
    """The backend's database (same server, login and database) through the asyncio dialect under test."""
    return sa.make_url(backend.url).set(drivername=async_form).render_as_string(hide_password=False)


def invoke(*args: str, url: str | None = None, **env: str) -> Result:
    """``sa-taskqueue ARGS`` in this process, its output piped (not a terminal), as a script reads it."""
    return CliRunner().invoke(cli, list(args), env={"SA_TASKQUEUE_DATABASE_URL": url, **env})


def ok(*args: str, url: str | None = None, **env: str) -> str:
    result = invoke(*args, url=url, **env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


@pytest.fixture
def fresh_app_modules() -> Iterator[None]:
    """The test apps read their URL when first imported: import them afresh, and put the old ones back.

    Putting back, not forgetting: other tests hold functions of these modules
    (a process target pickled by reference must still be the module's own).
    """
    apps = ("tests.cli_app", "tests.async_cli_app", "tests.cli_own_table_app", "tests.periodic_app")
    before = {name: sys.modules.pop(name) for name in apps if name in sys.modules}
    yield
    for name in apps:
        sys.modules.pop(name, None)
    sys.modules.update(before)


# Every command on an async URL --------------------------------------------------------


def test_every_admin_command_works_on_an_async_url(async_url: str, engine: sa.Engine) -> None:
    out = ok("enqueue", "shop.mail", "--params", '{"to": "a@example.com"}', "--queue", "mail", url=async_url)
    [task] = task_rows(engine)
    assert f"enqueued task {task.id} (shop.mail)" in out
    assert (task.name, task.queue, task.params) == ("shop.mail", "mail", {"to": "a@example.com"})

    assert "mail" in ok("status", url=async_url)
    [listed] = json.loads(ok("list", "--json", url=async_url))
    assert (listed["id"], listed["name"]) == (task.id, "shop.mail")
    assert json.loads(ok("show", str(task.id), "--json", url=async_url))["params"] == {"to": "a@example.com"}

    assert f"cancelled task {task.id}" in ok("cancel", str(task.id), url=async_url)
    assert task_row(engine, task.id).status == tq.TaskStatus.CANCELLED
    assert "queued 1 task(s) to run again" in ok("retry", str(task.id), url=async_url)
    assert task_row(engine, task.id).status == tq.TaskStatus.QUEUED

    ok("pause", "mail", url=async_url)
    assert "paused queues: mail" in ok("status", url=async_url)
    ok("resume", "mail", url=async_url)
    assert "paused queues: none" in ok("status", url=async_url)

    with Session(engine) as session:
        session.add(
            tq.Task(
                name="old",
                status=tq.TaskStatus.COMPLETED,
                finished_at=datetime.now(UTC) - timedelta(days=30),
            )
        )
        session.commit()
    assert "deleted 1 task(s)" in ok("purge", "--completed", "--older-than", "7d", url=async_url)
    assert [t.id for t in task_rows(engine)] == [task.id]

    assert "ok" in json.loads(ok("health", "--json", url=async_url))
    doctor = ok("doctor", url=async_url)
    assert "passed" in doctor and "FAILED" not in doctor, doctor


@pytest.mark.backends("postgres", "postgres18", "mysql", "mariadb")  # servers: a port nothing listens on
def test_an_unreachable_server_on_an_async_url_is_one_line(backend: Backend, async_form: str) -> None:
    unreachable = sa.make_url(backend.url).set(
        drivername=async_form, host="127.0.0.1", port=1, username="u", password="secret"
    )
    result = invoke("status", "--url", unreachable.render_as_string(hide_password=False))
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"error: cannot use the database at {async_form}://u:***@127.0.0.1:1/"), message
    assert "secret" not in message


@pytest.mark.usefixtures("fresh_app_modules")
def test_schedules_of_an_app_read_through_an_async_url(async_url: str, backend: Backend) -> None:
    # APP's registrations, its control table in the database the async --url names.
    out = ok("schedules", "--app", "tests.periodic_app:cli_queue", "--url", async_url, url=backend.url)
    assert "tick_every_second" in out and "nightly_paris" in out


@pytest.mark.slow  # starts worker processes
def test_the_demo_runs_on_an_async_url(async_url: str) -> None:
    result = run_cli("demo", "--tasks", "40", "--workers", "2", "--url", async_url, url=async_url)
    assert result.returncode == 0, result.stderr
    assert "every task ran exactly once" in result.stdout
    assert "completed 40" in result.stdout


# migrate ------------------------------------------------------------------------------


def _drop_everything(engine: sa.Engine) -> None:
    tq.metadata.drop_all(engine)
    with engine.begin() as connection:
        sa.Table(migrate.VERSION_TABLE, sa.MetaData()).drop(connection, checkfirst=True)


@pytest.fixture
def empty_database(engine: sa.Engine) -> Iterator[None]:
    """No task table and no version table; afterwards, the tables other tests expect."""
    _drop_everything(engine)
    engine.dispose()
    try:
        yield
    finally:
        engine.dispose()  # forget connections that saw the schema the command changed
        _drop_everything(engine)
        tq.metadata.create_all(engine)


def _tables(engine: sa.Engine) -> set[str]:
    engine.dispose()
    return set(sa.inspect(engine).get_table_names())


@pytest.mark.usefixtures("empty_database")
def test_migrate_on_an_async_url_creates_the_tables(async_url: str, engine: sa.Engine) -> None:
    assert "to head" in ok("migrate", "--url", async_url)
    assert {"sa_taskqueue_task", "sa_taskqueue_task_control", migrate.VERSION_TABLE} <= _tables(engine)


@pytest.mark.usefixtures("empty_database", "fresh_app_modules")
def test_migrate_app_migrates_the_apps_database_through_its_engine(
    backend: Backend, engine: sa.Engine
) -> None:
    # The URL is the app's (it reads it from the environment): migrate takes none of its own here.
    out = ok("migrate", "--app", "tests.cli_app:queue", url=backend.url)
    assert "to head" in out
    assert "sa_taskqueue_task" in _tables(engine)
    assert "to head" in ok("migrate", "--app", "tests.cli_app:queue", url=backend.url), "again: nothing to do"


@pytest.mark.usefixtures("empty_database", "fresh_app_modules")
def test_migrate_app_whose_only_engine_is_async(backend: Backend, async_form: str, engine: sa.Engine) -> None:
    driver = async_form.partition("+")[2].removesuffix("_async")
    ok(
        "migrate",
        "--app",
        "tests.async_cli_app:queue",
        url=backend.url,
        SA_TASKQUEUE_TEST_ASYNC_DRIVER=driver,
    )
    assert "sa_taskqueue_task" in _tables(engine)


@pytest.mark.usefixtures("fresh_app_modules")
def test_migrate_app_refuses_a_table_of_the_apps_own_base(backend: Backend, engine: sa.Engine) -> None:
    before = _tables(engine)
    result = invoke("migrate", "--app", "tests.cli_own_table_app:queue", url=backend.url)
    assert result.exit_code == 1, result.output
    message = result.stderr.strip()
    assert len(message.splitlines()) == 1, message
    assert "uses a task table of its own, 'app_job'" in message
    assert "only the library's table, 'sa_taskqueue_task'" in message
    assert "'app_job' and 'app_job_control' with the application's own Alembic" in message
    assert _tables(engine) == before, "nothing created"


# postgres:// --------------------------------------------------------------------------


@pytest.mark.backends("sqlite")  # refused before anything connects
@pytest.mark.parametrize(
    ("url", "advice"),
    [
        (
            "postgres://u@db.example/x",
            "SQLAlchemy calls PostgreSQL postgresql, not postgres: write the URL as postgresql+psycopg://... "
            "(pip install 'sa_taskqueue[postgresql]')",
        ),
        (
            "postgres+asyncpg://u@db.example/x",
            "SQLAlchemy calls PostgreSQL postgresql, not postgres: write the URL as postgresql+asyncpg://...",
        ),
    ],
)
@pytest.mark.parametrize("command", ["status", "migrate"])
def test_a_postgres_url_is_told_the_scheme_to_write(
    backend: Backend, url: str, advice: str, command: str
) -> None:
    result = invoke(command, "--url", url)
    assert result.exit_code == 1, result.output
    assert result.stderr == f"error: bad database URL {url}: {advice}\n"


@pytest.mark.backends("sqlite")
@pytest.mark.usefixtures("fresh_app_modules")
@pytest.mark.parametrize(
    ("url", "scheme"),
    [
        ("postgres://u@db.example/x", "postgresql+psycopg://"),
        ("postgres+asyncpg://u@db.example/x", "postgresql+asyncpg://"),
    ],
)
def test_an_app_whose_url_is_postgres_is_told_the_scheme_to_write(
    backend: Backend, url: str, scheme: str
) -> None:
    # The application builds its engine when imported, from the URL the environment gives it.
    result = invoke("list", "--app", "tests.cli_app:queue", url=url)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(
        "error: cannot import 'tests.cli_app': its database URL: SQLAlchemy calls PostgreSQL postgresql, "
        f"not postgres: write the URL as {scheme}..."
    ), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


# Piped output -------------------------------------------------------------------------

LONG_NAME = "shop.orders.send_the_order_confirmation_email_to_the_customer_after_checkout"
LONG_QUEUE = "shop.transactional_mail_for_customers_in_every_region"


def test_tables_keep_full_names_when_the_output_is_not_a_terminal(
    backend: Backend, engine: sa.Engine
) -> None:
    with Session(engine) as session:
        task = tq.Task(name=LONG_NAME, queue=LONG_QUEUE, locked_by="host.example.com:4242:abcdef01")
        session.add(task)
        session.commit()
        task_id = task.id
    # An 80-column terminal's width, as a script's environment may well say: not a terminal all the same.
    listed = ok("list", url=backend.url, COLUMNS="80")
    assert LONG_NAME in listed and LONG_QUEUE in listed and "…" not in listed, listed
    status = ok("status", url=backend.url, COLUMNS="80")
    assert LONG_QUEUE in status and "…" not in status, status
    shown = ok("show", str(task_id), url=backend.url, COLUMNS="80")
    assert LONG_NAME in shown and LONG_QUEUE in shown and "…" not in shown, shown
