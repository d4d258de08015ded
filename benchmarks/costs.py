"""What a drain costs the server: its CPU time and the statements it was sent, read around one run.

A `Meter` is read immediately before the start signal and again once every
worker has reported, so seeding, schema set-up and the workers' start-up are
left out.  Both figures are counted, not timed, so they hold on a machine
busy with other work, unlike a rate.

- Server CPU, for a server on this machine only (the URL's host empty,
  ``localhost`` or a loopback address), from ``/proc``: on PostgreSQL the
  postmaster serving the meter's own connection, its children (every
  backend and auxiliary process) and the children it has reaped (backends
  that exited during the run, in its ``cutime``/``cstime``); on
  MariaDB/MySQL the server process, all of whose threads it counts.  It is
  the whole server's: other databases' clients on it add theirs, which the
  meter reports where it can (`Usage.elsewhere`).
- Statements, counted by the server: on PostgreSQL the top-level calls
  ``pg_stat_statements`` recorded in the run's database (the extension must
  be preloaded); on MariaDB/MySQL the global ``Questions`` counter less the
  meter's own reads, so any other client's statements count too.

SQLite has no server: its work is in the client's CPU, and its statements
are not counted.  Where a figure cannot be had it is None, and `Meter.notes`
says why.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

#: The hosts a URL may name for a server on this machine.
LOCAL_HOSTS = {None, "", "localhost", "127.0.0.1", "::1"}

#: The notes on figures that cannot be had, as tables print them.
IN_THE_CLIENT = "SQLite: no server, its work is in the client CPU; statements not counted"
REMOTE = "server CPU: n/a, the server is not on this machine"
NO_PG_STAT_STATEMENTS = "statements: n/a, pg_stat_statements is not preloaded on the server"
EVICTED = "statements: n/a where pg_stat_statements evicted entries during the run"

#: The top-level calls in the meter's database and in all others, leaving out the meter's own reads.
PG_STATEMENTS = sa.text(
    """
    SELECT coalesce(sum(calls) FILTER (WHERE dbid = d.oid), 0),
           coalesce(sum(calls) FILTER (WHERE dbid <> d.oid), 0),
           (SELECT dealloc FROM pg_stat_statements_info)
    FROM pg_stat_statements, (SELECT oid FROM pg_database WHERE datname = current_database()) d
    WHERE toplevel AND strpos(query, 'pg_stat_statements') = 0
    """
)


@dataclass(frozen=True)
class Usage:
    """What the server did between two readings; None where not measured."""

    server_cpu: float | None = None  # seconds
    statements: int | None = None
    #: Statements other databases on the same server ran meanwhile (PostgreSQL): work in `server_cpu`.
    elsewhere: int | None = None
    notes: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class _Reading:
    cpu: float | None
    statements: int | None
    elsewhere: int | None
    evictions: int | None


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field (state) on, or None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The second field, the command, is in parentheses and may hold spaces or parentheses.
    return text[text.rindex(")") + 2 :].split()


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


#: Offsets in `_stat`'s fields (``man 5 proc``: field n is at n - 3).
PPID, UTIME, STIME, CUTIME, CSTIME = 1, 11, 12, 13, 14
TICK = os.sysconf("SC_CLK_TCK")


def _ticks(fields: list[str], *offsets: int) -> int:
    return sum(int(fields[offset]) for offset in offsets)


def postgres_cpu(postmaster: int) -> float | None:
    """CPU seconds of a PostgreSQL server: the postmaster, its children, and those it has reaped.

    The scan is read again should a child be reaped while it runs (the
    postmaster's reaped time moving), so that no backend is counted twice
    or missed.
    """
    for _ in range(5):
        before = _stat(postmaster)
        if before is None:
            return None
        total = _ticks(before, UTIME, STIME, CUTIME, CSTIME)
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
        for pid in pids:
            fields = _stat(pid)
            if fields is not None and int(fields[PPID]) == postmaster:
                total += _ticks(fields, UTIME, STIME)
        after = _stat(postmaster)
        if after is not None and _ticks(after, CUTIME, CSTIME) == _ticks(before, CUTIME, CSTIME):
            return total / TICK
    return None


def process_cpu(pid: int) -> float | None:
    """CPU seconds of one process, all its threads."""
    fields = _stat(pid)
    return None if fields is None else _ticks(fields, UTIME, STIME) / TICK


def _mysql_server_pid(conn: sa.Connection) -> int | None:
    """The MariaDB/MySQL server's pid: from its pid file where readable, else its only process here."""
    names = ("mariadbd", "mysqld")
    with contextlib.suppress(OSError, ValueError, sa.exc.DBAPIError):
        pid = int(Path(str(conn.exec_driver_sql("SELECT @@pid_file").scalar())).read_text().strip())
        if _comm(pid) in names:
            return pid
    found = [int(name) for name in os.listdir("/proc") if name.isdigit() and _comm(int(name)) in names]
    return found[0] if len(found) == 1 else None


class Meter:
    """Readings of one server's CPU and statements, for `start` and `stop` around a run.

    Connects on creation, so its own connection's set-up is not counted; `close` when done.
    """

    def __init__(self, url: str) -> None:
        parsed = sa.make_url(url)
        self.dialect = parsed.get_backend_name()
        self.notes: set[str] = set()
        self._engine: sa.Engine | None = None
        self._conn: sa.Connection | None = None
        self._server_pid: int | None = None
        self._pg_stat_statements = False
        self._before: _Reading | None = None
        if self.dialect == "sqlite":
            self.notes.add(IN_THE_CLIENT)
            return
        if self.dialect == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        self._engine = sa.create_engine(parsed, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        self._conn = self._engine.connect()
        local = parsed.host in LOCAL_HOSTS
        if self.dialect == "postgresql":
            self._set_up_postgres(local)
        elif self.dialect in ("mysql", "mariadb"):
            self._server_pid = _mysql_server_pid(self._conn) if local else None
        if self._server_pid is None:
            self.notes.add(REMOTE)

    def _set_up_postgres(self, local: bool) -> None:
        assert self._conn is not None
        backend = int(self._conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
        fields = _stat(backend) if local else None
        if fields is not None and _comm(int(fields[PPID])).startswith("postgres"):
            self._server_pid = int(fields[PPID])
        try:
            self._conn.exec_driver_sql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            self._conn.execute(PG_STATEMENTS)
            self._pg_stat_statements = True
        except sa.exc.DBAPIError:  # not preloaded (or not ours to create): no counts
            self.notes.add(NO_PG_STAT_STATEMENTS)

    def _read(self) -> _Reading:
        conn = self._conn
        statements = elsewhere = evictions = None
        if conn is not None and self.dialect == "postgresql" and self._pg_stat_statements:
            ours, others, dealloc = conn.execute(PG_STATEMENTS).one()
            statements, elsewhere, evictions = int(ours), int(others), int(dealloc or 0)
        elif conn is not None and self.dialect in ("mysql", "mariadb"):
            statements = int(conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Questions'").one()[1])
        cpu = None
        if self._server_pid is not None:
            if self.dialect == "postgresql":
                cpu = postgres_cpu(self._server_pid)
            else:
                cpu = process_cpu(self._server_pid)
        return _Reading(cpu, statements, elsewhere, evictions)

    def start(self) -> None:
        """The reading a run's usage is counted from: take it just before the run's start signal."""
        self._before = self._read()

    def stop(self) -> Usage:
        """The server's usage since `start`."""
        assert self._before is not None, "start() first"
        before, after = self._before, self._read()
        statements = _delta(before.statements, after.statements)
        if statements is not None and self.dialect in ("mysql", "mariadb"):
            statements -= 1  # this reading's own SHOW, counted as it ran
        if _delta(before.evictions, after.evictions):
            statements = None
            self.notes.add(EVICTED)
        cpu = None
        if before.cpu is not None and after.cpu is not None:
            cpu = after.cpu - before.cpu
        return Usage(
            server_cpu=cpu,
            statements=statements,
            elsewhere=_delta(before.elsewhere, after.elsewhere),
            notes=frozenset(self.notes),
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._engine is not None:
            self._engine.dispose()

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before
