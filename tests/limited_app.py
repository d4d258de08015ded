"""A test application with a concurrency-limited task, and its worker process for the race test.

The task keeps, per key, a counter of its runs in progress and the highest
value it ever reached, each move in a transaction of its own committed before
the task returns: the peak is how many ran at once, as the tasks saw it.
Run as ``python -m tests.limited_app ...`` it is one racing worker process.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import sa_taskqueue as tq
from sa_taskqueue.core.types import utcnow
from tests.app import make_engine
from tests.helpers import wait_until

LIMIT = 2


class LimitedBase(DeclarativeBase):
    pass


class Overlap(LimitedBase):
    """Per key: runs in progress now, and the most there ever were at once."""

    __tablename__ = "test_limited_overlap"

    key: Mapped[str] = mapped_column(sa.String(50), primary_key=True)
    running: Mapped[int] = mapped_column(default=0)
    peak: Mapped[int] = mapped_column(default=0)


class Run(LimitedBase):
    """One run of a limited task, written by the task."""

    __tablename__ = "test_limited_run"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    n: Mapped[int] = mapped_column(index=True)


def reset(engine: sa.Engine, keys: list[str]) -> None:
    LimitedBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(Run.__table__.delete())
        conn.execute(Overlap.__table__.delete())
        conn.execute(sa.insert(Overlap), [{"key": key, "running": 0, "peak": 0} for key in keys])


def make_limited_queue(
    engine: sa.Engine,
    strategy: str | None,
    lease: timedelta,
    clock: Callable[[], datetime] = utcnow,
    *,
    limit: int | None = LIMIT,
) -> tq.TaskQueue:
    """A queue with ``limited`` (at most ``limit`` per ``key``), ``whole`` (1 at all) and ``plain``."""
    queue = tq.TaskQueue(engine, strategy=strategy, lease=lease, clock=clock)

    @queue.task(name="limited", concurrency_limit=limit, concurrency_key="key" if limit else None)
    def limited(key: str, n: int, sleep: float = 0.0) -> None:
        started = (
            sa.update(Overlap)
            .where(Overlap.key == key)
            # peak first: MySQL evaluates SET left to right with the new values.
            .ordered_values(
                (
                    Overlap.peak,
                    sa.case((Overlap.running + 1 > Overlap.peak, Overlap.running + 1), else_=Overlap.peak),
                ),
                (Overlap.running, Overlap.running + 1),
            )
        )
        with engine.begin() as conn:
            conn.execute(started)
        time.sleep(sleep)
        with engine.begin() as conn:
            conn.execute(sa.update(Overlap).where(Overlap.key == key).values(running=Overlap.running - 1))
            conn.execute(sa.insert(Run).values(n=n))

    @queue.task(name="whole", concurrency_limit=1)
    def whole(n: int) -> int:
        return n

    @queue.task(name="plain")
    def plain(n: int) -> int:
        return n

    return queue


def peaks(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(Overlap.key, Overlap.peak)).all()
    return {str(key): int(peak) for key, peak in rows}


def runs(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(Run.n)).scalars())


def _left(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count())
            .select_from(tq.Task)
            .where(tq.Task.status.in_([tq.TaskStatus.QUEUED, tq.TaskStatus.RUNNING]))
        ).scalar_one()


def _race(args: argparse.Namespace) -> None:
    """Run a worker of ``args.concurrency`` threads from the start signal until no task is left."""
    engine = make_engine(args.url)
    queue = make_limited_queue(engine, args.strategy, timedelta(minutes=5), limit=args.limit or None)
    queue.strategy  # noqa: B018 - connect and resolve before the start line
    worker = tq.Worker(queue, concurrency=args.concurrency, poll_interval=0.05, listen=False, watchdog=False)

    def stop_when_drained() -> None:
        wait_until(lambda: _left(engine) == 0, 300, "the queue to drain", every=0.1)
        worker.stop()

    Path(args.ready).touch()
    wait_until(Path(args.go).exists, 300, "the start signal", every=0.01)
    threading.Thread(target=stop_when_drained, daemon=True).start()
    worker.run()
    queue.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--limit", type=int, default=LIMIT, help="0: no limit")
    parser.add_argument("--ready", required=True)
    parser.add_argument("--go", required=True)
    _race(parser.parse_args())


if __name__ == "__main__":
    main()
