"""The task table as the soak sees it: a fresh table of soak tasks, and what has become of them.

Every read is on a connection of its own (no pool), so a fault that cuts
sessions or restarts the server costs the soak one missed read, reported as
None, and never a stale connection.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

import sa_taskqueue as tq

#: Lost attempts are what the soak causes, several per run: a task should not
#: run out of them, so that a FAILED row means something other than a fault.
MAX_ATTEMPTS = 20

#: The share of tasks that run longer than a third of the lease, so that they
#: live through lease renewals; the rest take 0-20 ms.
LONG_SHARE = 0.003


def durations(count: int, lease: float, seed: int) -> list[float]:
    """How long each task sleeps: mostly 0-20 ms, sometimes from a third of the lease to 1.25 leases."""
    rng = random.Random(seed)
    return [
        rng.uniform(lease / 3, lease * 1.25) if rng.random() < LONG_SHARE else rng.uniform(0, 0.02)
        for _ in range(count)
    ]


def seed_tasks(url: str, sleeps: list[float]) -> None:
    """One due ``soak`` task per sleep, committed together."""
    engine = sa.create_engine(url)
    now = datetime.now(UTC)
    base = {
        "name": "soak",
        "queue": "default",
        "priority": 0,
        "status": tq.TaskStatus.QUEUED,
        "run_at": now - timedelta(seconds=1),
        "attempts": 0,
        "max_attempts": MAX_ATTEMPTS,
        "created_at": now,
    }
    with engine.begin() as conn:
        for start in range(0, len(sleeps), 5000):
            rows = [{**base, "params": {"sleep": round(s, 4)}} for s in sleeps[start : start + 5000]]
            conn.execute(sa.insert(tq.Task), rows)
    engine.dispose()


class TaskTable:
    """Reads of the soak's task table that survive the faults: None when the database did not answer."""

    def __init__(self, url: str) -> None:
        connect_args: dict[str, object] = {}
        if not url.startswith("sqlite"):
            connect_args = {"connect_timeout": 3}
        self.engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=connect_args)
        self.table: sa.Table = tq.Task.__table__  # type: ignore[assignment]

    def counts(self) -> dict[str, int] | None:
        """Tasks per status."""
        query = sa.select(self.table.c.status, sa.func.count()).group_by(self.table.c.status)
        try:
            with self.engine.connect() as conn:
                return {str(status): int(count) for status, count in conn.execute(query)}
        except sa.exc.DBAPIError:
            return None

    def running_ids(self, worker_pid: int | None = None) -> list[int] | None:
        """Tasks RUNNING now: all, or those claimed by the worker process ``worker_pid``."""
        query = sa.select(self.table.c.id).where(self.table.c.status == tq.TaskStatus.RUNNING)
        if worker_pid is not None:  # worker ids are host:pid:token
            query = query.where(self.table.c.locked_by.like(f"%:{worker_pid}:%"))
        try:
            with self.engine.connect() as conn:
                return [int(task_id) for task_id in conn.execute(query).scalars()]
        except sa.exc.DBAPIError:
            return None

    def running_per_worker(self) -> dict[int, int] | None:
        """How many tasks each worker process holds RUNNING, by pid (worker ids are host:pid:token)."""
        query = (
            sa.select(self.table.c.locked_by, sa.func.count())
            .where(self.table.c.status == tq.TaskStatus.RUNNING)
            .group_by(self.table.c.locked_by)
        )
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(query).all()
        except sa.exc.DBAPIError:
            return None
        held: dict[int, int] = {}
        for locked_by, count in rows:
            parts = str(locked_by).split(":")
            if len(parts) >= 3 and parts[-2].isdigit():
                held[int(parts[-2])] = held.get(int(parts[-2]), 0) + int(count)
        return held

    def first_completion_after(self, moment: float) -> float | None:
        """When the first task completed after ``moment`` (epoch seconds); None if none yet, or no answer."""
        query = sa.select(sa.func.min(self.table.c.finished_at)).where(
            self.table.c.status == tq.TaskStatus.COMPLETED,
            self.table.c.finished_at > datetime.fromtimestamp(moment, UTC),
        )
        try:
            with self.engine.connect() as conn:
                first = conn.execute(query).scalar_one()
        except sa.exc.DBAPIError:
            return None
        return None if first is None else _epoch(first)

    def last_completion_of(self, ids: list[int]) -> float | None:
        """When the last of ``ids`` completed, once all have; None until then, or with no answer."""
        query = sa.select(sa.func.count(), sa.func.max(self.table.c.finished_at)).where(
            self.table.c.id.in_(ids), self.table.c.status == tq.TaskStatus.COMPLETED
        )
        try:
            with self.engine.connect() as conn:
                completed, last = conn.execute(query).one()
        except sa.exc.DBAPIError:
            return None
        return _epoch(last) if completed == len(ids) and last is not None else None

    def statuses(self) -> dict[int, str] | None:
        """Every task's status, by id."""
        query = sa.select(self.table.c.id, self.table.c.status)
        try:
            with self.engine.connect() as conn:
                return {int(task_id): str(status) for task_id, status in conn.execute(query)}
        except sa.exc.DBAPIError:
            return None

    def close(self) -> None:
        self.engine.dispose()


def _epoch(moment: datetime) -> float:
    """Epoch seconds of a datetime read back from the table (aware UTC; naive taken as UTC)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
