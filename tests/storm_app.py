"""The workflow storm's application: batch members, dependency-graph nodes and callbacks, and its worker.

- ``member`` does nothing (or fails, when told): a batch's 10,000 members.
- ``node`` is a node of the dependency graph: at its start it reads its
  parents' rows and commits at once, in ``test_storm_start``, whether every
  one of them had completed; a start that saw a parent unfinished is a
  dependent run before its parents.
- ``callback`` is a batch's callback, transactional: its row in
  ``test_storm_callback`` commits with its completion, so two rows for one
  batch and outcome would be two runs that both finished.

Run as ``python -m tests.storm_app ...`` it is one worker process of the storm.
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import sa_taskqueue as tq
from tests.app import make_engine


class StormBase(DeclarativeBase):
    pass


class StormStart(StormBase):
    """One start of a graph node, and whether all its parents had completed then."""

    __tablename__ = "test_storm_start"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    node: Mapped[int] = mapped_column(index=True)
    parents_completed: Mapped[bool]


class StormCallback(StormBase):
    """One finished run of a batch's callback: its batch, its outcome and the counts it was given."""

    __tablename__ = "test_storm_callback"

    id: Mapped[int] = mapped_column(sa.Identity(), primary_key=True)
    batch_id: Mapped[int]
    outcome: Mapped[str] = mapped_column(sa.String(20))
    total: Mapped[int]
    succeeded: Mapped[int]
    failed: Mapped[int]
    cancelled: Mapped[int]


def reset(engine: sa.Engine) -> None:
    StormBase.metadata.create_all(engine)
    with engine.begin() as conn:
        for table in StormBase.metadata.sorted_tables:
            conn.execute(table.delete())


def make_storm_queue(engine: sa.Engine, lease: timedelta) -> tq.TaskQueue:
    queue = tq.TaskQueue(engine, lease=lease)
    fast_retry = timedelta(milliseconds=1)
    task_table = tq.Task.__table__

    @queue.task(name="member", retry_delay=fast_retry)
    def member(n: int, fail: bool = False) -> int:
        if fail:
            raise RuntimeError(f"member {n} fails, as it was told to")
        return n

    @queue.task(name="node", retry_delay=fast_retry)
    def node(key: int, parents: list[int]) -> int:
        with engine.begin() as conn:
            statuses = conn.scalars(sa.select(task_table.c.status).where(task_table.c.id.in_(parents))).all()
            done = len(statuses) == len(parents) and all(
                tq.TaskStatus(status) is tq.TaskStatus.COMPLETED for status in statuses
            )
            conn.execute(sa.insert(StormStart).values(node=key, parents_completed=done))
        return key

    @queue.task(name="callback", transactional=True, retry_delay=fast_retry)
    def callback(session: Session, batch: dict[str, Any], outcome: str) -> None:
        session.add(
            StormCallback(
                batch_id=batch["id"],
                outcome=outcome,
                total=batch["total"],
                succeeded=batch["succeeded"],
                failed=batch["failed"],
                cancelled=batch["cancelled"],
            )
        )

    return queue


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--name", default="worker")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    queue = make_storm_queue(make_engine(args.url), timedelta(seconds=args.lease))
    # Without the watchdog, a stopped worker wakes after its leases ran out and others took its
    # tasks: only the fence keeps its writes, and its batch counts, from landing a second time.
    queue.run_worker(concurrency=args.concurrency, poll_interval=0.05, watchdog=False, listen=False)


if __name__ == "__main__":
    main()
