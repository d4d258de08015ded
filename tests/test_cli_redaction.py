"""The command line never prints a password: not from a URL, parsed or not, and not from the driver.

A secret may sit in a URL's userinfo, in a query parameter (``?password=``,
``?sslpassword=``, a token), or in a URL too broken to parse; whatever the
command and whichever way it ends, the secret appears in neither stdout nor
stderr, and ``***`` stands where it was.
"""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from tests.backends import Backend
from tests.helpers import run_cli

pytestmark = pytest.mark.slow  # real processes

SECRET = "s3cr3t-Pw9"


def assert_hidden(result: object) -> None:
    out = result.stdout + result.stderr  # type: ignore[attr-defined]
    assert SECRET not in out, out
    assert "s3cr3t" not in out, f"a part of the password was printed:\n{out}"
    assert "Traceback" not in result.stderr  # type: ignore[attr-defined]


@pytest.mark.backends("sqlite")  # URLs refused before any server is reached
@pytest.mark.parametrize(
    ("args", "url"),
    [
        # URLs that do not parse: a port that is not a number, no scheme, a bad IPv6 host.
        (("status",), f"postgresql+psycopg://app:{SECRET}@127.0.0.1:abc/db"),
        (("enqueue", "x"), f"app:{SECRET}@db.example/app"),
        (("cancel", "1"), f"postgresql+psycopg://app:{SECRET}@[::1/db"),
        (
            ("purge", "--completed", "--older-than", "1d"),
            f"mysql+pymysql://app:{SECRET}@h:x/db?password={SECRET}",
        ),
        # A password with an @ not written as %40: the tail would be taken for the host.
        (("retry", "1"), f"postgresql+psycopg://app:p@{SECRET}@127.0.0.1:1/db"),
        (("migrate",), f"postgresql+psycopg://app:x@{SECRET}@127.0.0.1:1/db"),
        # Unknown dialects, with the secret in the userinfo and in the query.
        (("status",), f"nope://app:{SECRET}@h/db"),
        (("enqueue", "x"), f"nope://app@h/db?password={SECRET}&sslmode=require"),
        (("retry", "--all-failed"), f"nope://app@h/db?token={SECRET}"),
        (("migrate",), f"nope://app@h/db?sslpassword={SECRET}"),
        (("purge", "--failed", "--older-than", "1d"), f"nope://app@h/db?PWD={SECRET}"),
    ],
)
def test_a_bad_url_is_named_without_its_secrets(backend: Backend, args: tuple[str, ...], url: str) -> None:
    for result in (run_cli(*args, "--url", url, url=backend.url), run_cli(*args, url=url)):
        assert result.returncode == 1, result.stderr
        assert_hidden(result)
        assert "***" in result.stderr, result.stderr


@pytest.mark.backends("sqlite")  # URLs refused before any server is reached
def test_the_demo_and_debug_tracebacks_hide_secrets_too(backend: Backend) -> None:
    demo = run_cli("demo", "--url", f"nope://app:{SECRET}@h/db?password={SECRET}", url=backend.url)
    assert demo.returncode == 1
    assert_hidden(demo)
    debug = run_cli(
        "--debug", "status", "--url", f"postgresql+psycopg://app@127.0.0.1:1/db?password={SECRET}", url=""
    )
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr, "--debug shows the traceback"
    assert SECRET not in debug.stdout + debug.stderr


def unreachable(backend: Backend) -> sa.URL:
    """The backend's server URL on a port nothing listens on."""
    return sa.make_url(backend.url).set(host="127.0.0.1", port=1)


@pytest.mark.backends("postgres", "mysql", "mariadb")  # a server the driver fails to reach
@pytest.mark.parametrize("where", ["userinfo", "query"])
def test_an_unreachable_server_is_named_without_its_secrets(backend: Backend, where: str) -> None:
    url = unreachable(backend)
    url = url.set(password=SECRET) if where == "userinfo" else url.update_query_dict({"password": SECRET})
    text = url.render_as_string(hide_password=False)
    for args in (("status",), ("enqueue", "x"), ("migrate",), ("worker", "tests.cli_app:queue", "--burst")):
        result = run_cli(*args, url=text)
        assert result.returncode == 1, result.stderr
        assert "cannot use the database" in result.stderr, result.stderr
        assert "***" in result.stderr, result.stderr
        assert_hidden(result)


#: A secret-named query parameter each driver accepts and, here, does not use.
IGNORED_SECRET = {
    "sqlite": "token",
    "postgres": "sslpassword",
    "postgres18": "sslpassword",
    "mysql": "ssl_key_password",
    "mariadb": "ssl_key_password",
}


def test_commands_that_succeed_print_the_url_with_its_secrets_hidden(
    backend: Backend, engine: sa.Engine
) -> None:
    url = sa.make_url(backend.url).update_query_dict({IGNORED_SECRET[backend.name]: SECRET})
    text = url.render_as_string(hide_password=False)
    demo = run_cli("demo", "--tasks", "4", "--workers", "1", "--url", text, url=backend.url)
    assert demo.returncode == 0, demo.stderr
    assert f"{IGNORED_SECRET[backend.name]}=***" in demo.stdout
    assert_hidden(demo)
    enqueued = run_cli("enqueue", "record", "--params", json.dumps({"key": 1}), url=text)
    assert enqueued.returncode == 0, enqueued.stderr
    worker = run_cli("worker", "tests.cli_app:queue", "--burst", "--log-level", "debug", url=text)
    assert worker.returncode == 0, worker.stderr
    assert "task" in worker.stderr
    assert_hidden(worker)
