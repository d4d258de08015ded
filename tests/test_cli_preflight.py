"""What the command line says before it reaches a database: a missing SQLite file, a missing driver,
its version, and the help of every worker option.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import sa_taskqueue
from sa_taskqueue.cli.main import cli, worker
from tests.backends import Backend

pytestmark = pytest.mark.backends("sqlite")  # nothing here needs a database server

APP_MODULE = "tests.cli_own_table_app"


def invoke(*args: str) -> click.testing.Result:
    return CliRunner().invoke(cli, list(args), env={"SA_TASKQUEUE_DATABASE_URL": None})


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("list",),
        ("show", "1"),
        ("enqueue", "mail.send"),
        ("retry", "--all-failed"),
        ("cancel", "1"),
        ("purge", "--completed", "--older-than", "1d"),
    ],
)
def test_a_missing_sqlite_file_is_named_and_not_created(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, "--url", "sqlite:///missing.db")
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == "error: no SQLite database at missing.db"
    assert list(tmp_path.iterdir()) == [], "no empty database file is left behind"


@pytest.fixture
def app_imported_afresh() -> Iterator[None]:
    """The test app reads its URL when first imported: import it afresh here, and forget it after."""
    sys.modules.pop(APP_MODULE, None)
    yield
    sys.modules.pop(APP_MODULE, None)


@pytest.mark.usefixtures("app_imported_afresh")
def test_a_missing_sqlite_file_of_an_app_is_named_too(
    backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "app.db"
    monkeypatch.setenv("SA_TASKQUEUE_DATABASE_URL", f"sqlite:///{missing}")
    result = CliRunner().invoke(cli, ["list", "--app", f"{APP_MODULE}:queue"])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == f"error: no SQLite database at {missing}"
    assert not missing.exists()


def test_migrate_still_creates_the_sqlite_file(backend: Backend, tmp_path: Path) -> None:
    created = tmp_path / "new.db"
    result = invoke("migrate", "--url", f"sqlite:///{created}")
    assert result.exit_code == 0, result.output
    assert created.exists()
    assert invoke("status", "--url", f"sqlite:///{created}").exit_code == 0


@pytest.mark.parametrize(
    ("url", "module", "advice"),
    [
        ("oracle+oracledb://scott@db.example/ORCL", "oracledb", "pip install 'sa_taskqueue[oracle]'"),
        ("postgresql+psycopg://u@db.example/x", "psycopg", "pip install 'sa_taskqueue[postgresql]'"),
        ("mysql+pymysql://u@db.example/x", "pymysql", "pip install 'sa_taskqueue[mysql]'"),
        ("mariadb+pymysql://u@db.example/x", "pymysql", "pip install 'sa_taskqueue[mysql]'"),
        ("postgresql+asyncpg://u@db.example/x", "asyncpg", "pip install 'sa_taskqueue[async]'"),
        ("sqlite+aiosqlite:///tasks.db", "aiosqlite", "pip install 'sa_taskqueue[async]'"),
        ("postgresql+psycopg_async://u@db.example/x", "psycopg", "pip install 'sa_taskqueue[async]'"),
        (
            "mysql://u@db.example/x",
            "MySQLdb",
            "pip install 'sa_taskqueue[mysql]' and write the URL as mysql+pymysql://",
        ),
        (
            "postgresql+psycopg2://u@db.example/x",
            "psycopg2",
            "pip install 'sa_taskqueue[postgresql]' and write the URL as postgresql+psycopg://",
        ),
    ],
)
def test_a_missing_driver_names_the_extra_that_installs_it(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, url: str, module: str, advice: str
) -> None:
    # As if the driver were not installed: importing it fails as it would then.
    monkeypatch.setitem(sys.modules, module, None)
    result = invoke("status", "--url", url)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"error: a database driver is missing ({module}): {advice}"), (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.usefixtures("app_imported_afresh")
def test_an_app_whose_driver_is_missing_names_the_extra(
    backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The application builds its engine when imported: the import is what fails.
    monkeypatch.setitem(sys.modules, "oracledb", None)
    monkeypatch.setenv("SA_TASKQUEUE_DATABASE_URL", "oracle+oracledb://scott@db.example/ORCL")
    result = CliRunner().invoke(cli, ["list", "--app", f"{APP_MODULE}:queue"])
    assert result.exit_code == 1, result.output
    assert result.stderr.strip() == (
        f"error: cannot import '{APP_MODULE}': a database driver is missing (oracledb): "
        "pip install 'sa_taskqueue[oracle]'"
    )


def test_version_prints_the_package_version(backend: Backend) -> None:
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"sa-taskqueue {sa_taskqueue.__version__}\n"


def test_every_worker_option_has_help(backend: Backend) -> None:
    options = [param for param in worker.params if isinstance(param, click.Option)]
    assert options
    assert [option.name for option in options if not option.help] == []
    shown = invoke("worker", "--help")
    assert shown.exit_code == 0
    assert "APP is imported like" in " ".join(shown.stdout.split())


def test_list_and_show_read_a_row_whose_params_are_not_json(backend: Backend, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'raw.db'}"
    assert invoke("migrate", "--url", url).exit_code == 0
    engine = sa.create_engine(url)
    with engine.begin() as conn:  # written around the queue, as raw SQL can
        conn.execute(
            sa.text(
                "INSERT INTO sa_taskqueue_task (name, queue, priority, params, status, run_at, attempts, "
                "max_attempts, created_at) VALUES ('x', 'default', 0, '{not json', 'queued', "
                "'2026-01-01 00:00:00.000000', 0, 3, '2026-01-01 00:00:00.000000')"
            )
        )
    engine.dispose()
    shown = invoke("show", "1", "--url", url)
    assert shown.exit_code == 0, shown.output
    assert "{not json" in shown.stdout
    assert "(stored text, not JSON)" in shown.stdout
    listed = invoke("list", "--json", "--url", url)
    assert listed.exit_code == 0, listed.output
    assert '"params": "{not json"' in listed.stdout
