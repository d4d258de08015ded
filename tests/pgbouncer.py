"""A real PgBouncer in transaction pooling mode in front of the suite's PostgreSQL, for the self-test's tests.

Debian's package (``apt-get install pgbouncer``) is what the tests run; it is
started on a free port of its own (a package install may have started its
service on 6432), with trust authentication, and stopped at the end.
PgBouncer refuses to run as root: as root it runs as the ``postgres`` account.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import sqlalchemy as sa

#: Where Debian installs it (``/usr/sbin`` is not on every user's PATH).
DEBIAN_PATH = "/usr/sbin/pgbouncer"
#: The account PgBouncer runs as when the tests run as root.
RUN_AS = "postgres"


def pgbouncer_binary() -> str:
    """PgBouncer's executable; the test fails (never skips) where it is not installed."""
    found = shutil.which("pgbouncer") or (DEBIAN_PATH if os.access(DEBIAN_PATH, os.X_OK) else None)
    if found is None:
        pytest.fail(
            "PgBouncer is not installed: install Debian's package (apt-get install pgbouncer); "
            "the self-test's tests run it in front of PostgreSQL"
        )
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def pgbouncer(server_url: str, pool_mode: str = "transaction") -> Iterator[str]:
    """PgBouncer in ``pool_mode`` in front of ``server_url``'s database; yields the URL through it."""
    binary = pgbouncer_binary()
    server = sa.make_url(server_url)
    port = free_port()
    directory = Path(tempfile.mkdtemp(prefix="sa_taskqueue_pgbouncer_"))
    directory.chmod(0o755)
    user = server.username or "postgres"
    (directory / "users.txt").write_text(f'"{user}" "{server.password or ""}"\n')
    (directory / "pgbouncer.ini").write_text(
        "[databases]\n"
        f"{server.database} = host={server.host or '127.0.0.1'} port={server.port or 5432} "
        f"dbname={server.database} user={user}\n"
        "[pgbouncer]\n"
        "listen_addr = 127.0.0.1\n"
        f"listen_port = {port}\n"
        "unix_socket_dir =\n"
        "auth_type = trust\n"
        f"auth_file = {directory / 'users.txt'}\n"
        f"pool_mode = {pool_mode}\n"
        f"logfile = {directory / 'pgbouncer.log'}\n"
        "ignore_startup_parameters = extra_float_digits,options\n"
    )
    command = [binary, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:
        shutil.chown(directory, user=RUN_AS)
        for path in directory.iterdir():
            shutil.chown(path, user=RUN_AS)
        command[1:1] = ["-u", RUN_AS]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = server.set(port=port, host="127.0.0.1").render_as_string(hide_password=False)
    try:
        _wait_until_it_answers(url, process, directory)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def _wait_until_it_answers(url: str, process: subprocess.Popen[str], directory: Path) -> None:
    """Poll with a real query for at most 20 s; fail with PgBouncer's words if it exits or never answers."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args={"connect_timeout": 2})
    deadline = time.monotonic() + 20
    try:
        while True:
            if process.poll() is not None:
                output = process.stdout.read() if process.stdout else ""
                log = directory / "pgbouncer.log"
                pytest.fail(f"pgbouncer exited with {process.returncode}: {output}{_text(log)}")
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                return
            except sa.exc.DBAPIError:
                if time.monotonic() > deadline:
                    pytest.fail(f"pgbouncer did not answer within 20 s: {_text(directory / 'pgbouncer.log')}")
                time.sleep(0.05)
    finally:
        engine.dispose()


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""
