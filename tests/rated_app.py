"""A test application with a rate-limited task, and its worker process for the race test.

The task writes one row per start, from inside the run: its number, its key
and the time it began (the worker's wall clock).  Run as
``python -m tests.rated_app ...`` it is one racing worker process.
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

#: The race's limit: at most this many starts per key in any window of WINDOW seconds.  Two
#: seconds rather than one, so that the tasks' own clocks still tell the windows apart on a busy
#: machine, where a run may begin most of a second after its claim (see `tests.test_rate_limits.peaks`).
LIMIT = 5
WINDOW = 2.0


def limit_spec(limit: int) -> str:
    """``rate_limit`` for at most ``limit`` starts in any window of WINDOW."""
    return f"{limit}/{WINDOW:g}s"


class RatedBase(DeclarativeBase):
    pass


class Start(RatedBase):
    """One start of a rate-limited task, written by the task as it begins."""

    __tablename__ = "test_rated_start"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    n: Mapped[int] = mapped_column(index=True)
    key: Mapped[str] = mapped_column(sa.String(50))
    at: Mapped[float] = mapped_column(sa.Float(precision=53))


def reset(engine: sa.Engine) -> None:
    RatedBase.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(Start.__table__.delete())


def make_rated_queue(
    engine: sa.Engine,
    strategy: str | None,
    clock: Callable[[], datetime] = utcnow,
    *,
    limit: str | tuple[str, ...] | None = limit_spec(LIMIT),
) -> tq.TaskQueue:
    """A queue with ``rated`` (``limit`` per ``key``, none if None) and ``plain``."""
    queue = tq.TaskQueue(engine, strategy=strategy, lease=timedelta(minutes=5), clock=clock)

    @queue.task(name="rated", rate_limit=limit, rate_key="key" if limit else None)
    def rated(key: str, n: int) -> None:
        at = time.time()
        with engine.begin() as conn:
            conn.execute(sa.insert(Start).values(n=n, key=key, at=at))

    @queue.task(name="plain")
    def plain(n: int) -> int:
        return n

    return queue


def starts(engine: sa.Engine) -> list[tuple[int, str, float]]:
    with engine.connect() as conn:
        return [(n, key, at) for n, key, at in conn.execute(sa.select(Start.n, Start.key, Start.at))]


def most_in_a_window(times: list[float], window: float) -> int:
    """The largest number of ``times`` in any closed window ``[t, t + window]``."""
    ordered = sorted(times)
    most = 0
    first = 0
    for last, moment in enumerate(ordered):
        while moment - ordered[first] > window:
            first += 1
        most = max(most, last - first + 1)
    return most


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
    queue = make_rated_queue(engine, args.strategy, limit=limit_spec(args.limit) if args.limit else None)
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
