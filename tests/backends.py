"""The live databases the suite runs against, and how each one is found.

A backend's URL comes from ``SA_TASKQUEUE_TEST_<NAME>_URL``, else the local
server of the development machine; when that is not answering and a Docker
engine is, a testcontainer is started instead.  When neither, the run stops
with one line saying what to set: a suite that silently skipped its database
would pass having tested nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import sqlalchemy as sa


@dataclass(frozen=True)
class Backend:
    """One database the conformance suite runs against."""

    name: str
    url: str

    @property
    def is_sqlite(self) -> bool:
        return self.name == "sqlite"

    @property
    def is_mysql_family(self) -> bool:
        return self.name in ("mysql", "mariadb")

    @property
    def strategies(self) -> list[str]:
        """Every strategy this backend can run; the shared tests run once per strategy."""
        return STRATEGIES[self.name]


STRATEGIES: dict[str, list[str]] = {
    "sqlite": ["conditional_update"],
    # conditional_update is PostgreSQL-capable but never its default, and is
    # exercised on MariaDB (where it is the default before 10.6).
    "postgres": ["skip_locked", "advisory_lock"],
    "mysql": ["skip_locked", "advisory_lock", "conditional_update"],
    "mariadb": ["skip_locked", "advisory_lock", "conditional_update"],
    "oracle": ["skip_locked"],
}

LOCAL_DEFAULTS: dict[str, str] = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+pymysql://root@127.0.0.1:3306/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
}


def env_var(name: str) -> str:
    return f"SA_TASKQUEUE_TEST_{name.upper()}_URL"


def reachable(url: str) -> bool:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=_fast_connect(url))
    try:
        with engine.connect():
            return True
    except sa.exc.DBAPIError:
        return False
    finally:
        engine.dispose()


def _fast_connect(url: str) -> dict[str, object]:
    if url.startswith("postgresql"):
        return {"connect_timeout": 3}
    if url.startswith("mysql"):
        return {"connect_timeout": 3}
    return {}


def docker_available() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _container(name: str) -> Callable[[], object]:
    # Imported lazily: testcontainers is only needed where Docker runs.
    def start() -> object:
        if name == "postgres":
            from testcontainers.postgres import PostgresContainer

            return PostgresContainer("postgres:16", driver="psycopg")
        if name == "mysql":
            from testcontainers.mysql import MySqlContainer

            return MySqlContainer("mysql:8.4", dialect="pymysql")
        if name == "mariadb":
            from testcontainers.mysql import MySqlContainer

            return MySqlContainer("mariadb:11.4", dialect="pymysql")
        from testcontainers.oracle import OracleDbContainer

        return OracleDbContainer("gvenzl/oracle-free:slim")

    return start


@contextmanager
def provision(name: str, tmp_dir: str) -> Iterator[Backend]:
    """Find (or start) the database for ``name``; raise `Unavailable` with what to set when none."""
    if name == "sqlite":
        url = os.environ.get(env_var(name)) or f"sqlite:///{tmp_dir}/sa_taskqueue_test.db"
        yield Backend(name, url)
        return
    configured = os.environ.get(env_var(name))
    if name == "mysql" and configured is None and docker_available():
        # The local server here is MariaDB speaking the MySQL protocol; where
        # Docker runs, tests-mysql tests a real MySQL 8 instead.
        with _container(name)() as running:  # type: ignore[attr-defined]
            yield Backend(name, running.get_connection_url())
        return
    candidate = configured or LOCAL_DEFAULTS.get(name)
    if candidate and reachable(candidate):
        yield Backend(name, candidate)
        return
    if configured is None and docker_available():
        container = _container(name)()
        with container as running:  # type: ignore[attr-defined]
            yield Backend(name, running.get_connection_url())
        return
    where = f"at {candidate}" if candidate else "(no local default)"
    raise Unavailable(
        f"no {name} database {where} and no Docker engine for a testcontainer: "
        f"start the server or set {env_var(name)} to a reachable URL"
    )


class Unavailable(RuntimeError):
    """No database could be found or started for the requested backend."""
