"""Periodic tasks: a registered task with a schedule, enqueued once per slot however many workers run.

A schedule is a cron expression in a time zone, or a fixed interval.  Its
*slots* are the instants it fires: the cron times in the zone (as `cronsim`
computes them, DST included), or the multiples of the interval counted from
the Unix epoch in UTC, so that every worker, on every machine, computes the
same slots without talking to the others.

Each schedule has a row in the control table (`sa_taskqueue.core.control`,
``kind="schedule"``, ``name=<task name>``) whose ``last_slot`` is the last
slot enqueued.  A worker enqueues a slot only by moving ``last_slot``
forward with one conditional UPDATE, and inserts the task in the same
transaction: the UPDATE of one worker changes the row, the others' change
nothing and enqueue nothing, so each slot is enqueued once, and a slot is
recorded exactly when its task commits.

Policies:

- Catch-up: a tick enqueues the latest slot that is due, never the ones
  before it.  Workers that were down for several slots run one task when
  they come back, not a burst.
- First sighting: the first tick that finds no row for a schedule records
  the latest past slot without running it, so deploying at 10:00 a task
  scheduled for 03:00 does not fire at once; the next slot runs normally.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError
from sqlalchemy import Connection, Engine, Table, Update, func, insert, or_, select, update
from sqlalchemy.exc import IntegrityError

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core import control
from sa_taskqueue.core.bulk_insert import insert_rows
from sa_taskqueue.core.exceptions import DatabaseUnavailable
from sa_taskqueue.core.notify import channel_name
from sa_taskqueue.features.ports import QueueContext
from sa_taskqueue.strategies.base import ClaimStrategy

if TYPE_CHECKING:
    from sa_taskqueue.core.registered import RegisteredTask

logger = logging.getLogger("sa_taskqueue")

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Schedule:
    """When a periodic task runs: ``cron`` in ``tz``, or ``every`` interval (exactly one of them).

    Slots are aware datetimes in UTC.  ``tz`` is where a cron expression is
    read; an interval's slots do not depend on it (they are counted from the
    epoch), it only says where they are shown.
    """

    cron: str | None
    every: timedelta | None
    tz: ZoneInfo

    @classmethod
    def of(cls, cron: Any, every: Any, tz: Any) -> Schedule:
        """A checked schedule: a clear error naming the argument for anything that cannot be one."""
        if (cron is None) == (every is None):
            raise TypeError("give exactly one of cron (a cron expression) and every (a timedelta)")
        zone = _zone(tz)
        if cron is not None:
            if not isinstance(cron, str):
                raise TypeError(f"cron must be a cron expression string, got {type(cron).__name__}")
            try:
                CronSim(cron, datetime(2000, 1, 1, tzinfo=zone))
            except CronSimError as error:
                raise ValueError(f"cron: {cron!r} is not a cron expression: {error}") from None
            return cls(" ".join(cron.split()), None, zone)
        if not isinstance(every, timedelta):
            raise TypeError(f"every must be a timedelta, got {type(every).__name__}")
        if every <= timedelta(0):
            raise ValueError(f"every must be a positive timedelta, got {every!r}")
        return cls(None, every, zone)

    def latest_slot(self, now: datetime) -> datetime | None:
        """The last slot at or before ``now`` (None if the cron expression has none in 50 years)."""
        if self.every is not None:
            return EPOCH + ((now - EPOCH) // self.every) * self.every
        assert self.cron is not None
        # cronsim steps back strictly before the start it is given, whole
        # seconds only: start one second after now's second to include now.
        start = now.astimezone(self.tz).replace(microsecond=0) + timedelta(seconds=1)
        try:
            latest = next(CronSim(self.cron, start, reverse=True)).astimezone(UTC)
        except StopIteration:
            return None
        # cronsim reads fixed-time expressions on the naive wall clock, so in
        # the repeated hour of a fall-back night stepping back can land a day
        # early; stepping forward from there finds the slot that really passed.
        while (following := self.next_slot(latest)) is not None and following <= now:
            latest = following
        return latest

    def next_slot(self, now: datetime) -> datetime | None:
        """The first slot after ``now`` (None if the cron expression has none in 50 years)."""
        if self.every is not None:
            return EPOCH + ((now - EPOCH) // self.every + 1) * self.every
        assert self.cron is not None
        # Strictly after whole-second ``start``: start from now's second.
        start = now.astimezone(self.tz).replace(microsecond=0)
        try:
            return next(CronSim(self.cron, start)).astimezone(UTC)
        except StopIteration:
            return None

    def describe(self) -> str:
        """``cron "*/5 * * * *"`` or ``every 0:05:00``, as the command line shows it."""
        if self.cron is not None:
            return f'cron "{self.cron}"'
        return f"every {self.every}"


@dataclass(frozen=True)
class PeriodicTask:
    """A registered task and its schedule, with the params each run gets."""

    task: RegisteredTask[Any, Any]
    schedule: Schedule
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.task.name


@dataclass(frozen=True)
class EnqueuedSlot:
    """One slot a tick enqueued: the task's name, the slot (UTC) and the new task's id (None on MySQL)."""

    name: str
    slot: datetime
    task_id: int | None


def _zone(tz: Any) -> ZoneInfo:
    if isinstance(tz, ZoneInfo):
        return tz
    if not isinstance(tz, str):
        raise TypeError(f"tz must be an IANA time zone name or a zoneinfo.ZoneInfo, got {type(tz).__name__}")
    try:
        return ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(f"tz: unknown time zone {tz!r} (an IANA name such as 'Europe/Paris')") from None


def slot_key(slot: datetime) -> str:
    """The ``unique_key`` of the task enqueued for ``slot``: its UTC ISO form."""
    return slot.astimezone(UTC).isoformat()


#: Builds the checked row of a periodic task's slot: (name, params, run_at) -> the row's values.
TaskValues = Callable[[str, dict[str, Any], datetime], dict[str, Any]]


class Schedules:
    """The periodic tasks of one queue, and the tick that enqueues each due slot exactly once."""

    def __init__(self, context: QueueContext, task_values: TaskValues) -> None:
        self._context = context
        self._task_values = task_values
        self._periodic: dict[str, PeriodicTask] = {}
        #: The schedules this queue has found a row of, in this process.
        self._rows_seen: set[str] = set()

    def add(self, periodic: PeriodicTask) -> None:
        """Register ``periodic`` (replacing one of the same name)."""
        self._periodic[periodic.name] = periodic

    @property
    def tasks(self) -> list[PeriodicTask]:
        """The periodic tasks, by name."""
        return [self._periodic[name] for name in sorted(self._periodic)]

    def enqueue_due(self) -> list[EnqueuedSlot]:
        """One tick: for each schedule, enqueue its latest due slot unless some worker already did.

        Each schedule is one short transaction of its own (and, the first time,
        one more to create its row); a schedule that is up to date costs one
        UPDATE that matches nothing.
        """
        context = self._context
        now = context.clock()
        strategy = context.strategy  # resolved here: it may connect, through the bridge itself
        controls = control.control_table_of(context.table)
        enqueued: list[EnqueuedSlot] = []
        seen = self._rows_seen
        for entry in self.tasks:
            slot = entry.schedule.latest_slot(now)
            if slot is None:
                continue
            # Checked before any SQL: the row is built once, the same for every worker.
            values = self._task_values(entry.name, entry.params, slot)
            values["unique_key"] = slot_key(slot)

            advance = partial(
                _advance_in_transaction, context, strategy, controls, entry.name, slot, now, values
            )
            with context.database_errors():
                outcome = context.call(advance)
                # No row changed: up to date, or no row yet.  Only a schedule this
                # process has not seen a row of tries to create one, so an up to
                # date schedule costs its one UPDATE.
                if outcome is _NO_ROW and entry.name not in seen:
                    create = partial(_create_row, context, strategy, controls, entry.name, slot, now)
                    created = context.call(create)
                    seen.add(entry.name)
                    if created:
                        logger.info(
                            "periodic task %s seen for the first time: slot %s recorded, not run; "
                            "next slot %s",
                            entry.name,
                            slot.isoformat(),
                            _iso(entry.schedule.next_slot(now)),
                        )
            if isinstance(outcome, EnqueuedSlot):
                seen.add(entry.name)
                enqueued.append(outcome)
                logger.info(
                    "periodic task %s: enqueued slot %s as task %s", entry.name, slot, outcome.task_id
                )
        return enqueued


class ScheduleSource(Protocol):
    """What a worker's schedule thread ticks: the queue's `TaskQueue.enqueue_due_schedules`."""

    @property
    def periodic_tasks(self) -> list[PeriodicTask]:
        """The periodic tasks registered, by name."""

    @property
    def clock(self) -> Callable[[], datetime]:
        """The queue's clock: slots are counted on it."""

    def enqueue_due_schedules(self) -> list[EnqueuedSlot]:
        """Enqueue each periodic task's latest due slot that no one enqueued yet."""


#: What `_advance` returns when its UPDATE changed no row: up to date, or no row yet.
_NO_ROW = object()


def _advance_in_transaction(
    context: QueueContext,
    strategy: ClaimStrategy,
    controls: Table,
    name: str,
    slot: datetime,
    now: datetime,
    values: dict[str, Any],
) -> EnqueuedSlot | object:
    with strategy.transaction(context.engine) as conn:
        return _advance(conn, controls, context.table, name, slot, now, values)


def _create_row(
    context: QueueContext, strategy: ClaimStrategy, controls: Table, name: str, slot: datetime, now: datetime
) -> bool:
    """Insert the schedule's row with ``slot`` as done; False if another worker created it first."""
    try:
        with strategy.transaction(context.engine) as conn:
            conn.execute(
                insert(controls).values(kind=control.SCHEDULE, name=name, last_slot=slot, updated_at=now)
            )
    except IntegrityError:
        return False  # the other worker recorded this same slot, or a later one
    return True


def _advance(
    conn: Connection,
    controls: Table,
    tasks: Table,
    name: str,
    slot: datetime,
    now: datetime,
    values: dict[str, Any],
) -> EnqueuedSlot | object:
    """Move ``last_slot`` to ``slot`` and insert its task, if no one did, in ``conn``'s transaction.

    Only the transaction whose UPDATE changed the row inserts the task.  A
    concurrent UPDATE of the same row waits for the first to commit, then
    finds ``last_slot`` no longer before ``slot`` and changes nothing
    (PostgreSQL re-reads the row it waited for; InnoDB's UPDATE reads the
    latest committed row whatever the isolation; SQLite writes one at a time).
    MySQL's drivers report rows matched, not changed, but a row matched here
    is always changed: its ``last_slot`` was before ``slot``.
    """
    result = conn.execute(advance_statement(controls, name, slot, now))
    if result.rowcount != 1:
        return _NO_ROW
    ids = insert_rows(conn, tasks, [values])
    if backend_for(conn.dialect).notify:
        # Wakes listening workers at commit, as an enqueue through a session does.
        conn.execute(select(func.pg_notify(channel_name(tasks), values["queue"])))
    return EnqueuedSlot(name, slot, ids[0] if ids else None)


def advance_statement(controls: Table, name: str, slot: datetime, now: datetime) -> Update:
    """The conditional UPDATE that claims ``slot`` for one schedule: it changes the row only if behind."""
    return (
        update(controls)
        .where(
            controls.c.kind == control.SCHEDULE,
            controls.c.name == name,
            or_(controls.c.last_slot.is_(None), controls.c.last_slot < slot),
        )
        .values(last_slot=slot, updated_at=now)
    )


def last_slots(engine: Engine, table: Table, names: Sequence[str]) -> dict[str, datetime | None]:
    """Each schedule's ``last_slot`` as the control table has it (names without a row are left out)."""
    controls = control.control_table_of(table)
    if not names:
        return {}
    with engine.connect() as conn:
        rows = conn.execute(
            select(controls.c.name, controls.c.last_slot).where(
                controls.c.kind == control.SCHEDULE, controls.c.name.in_(list(names))
            )
        ).all()
    return {row.name: row.last_slot for row in rows}


def report(
    periodic: Sequence[PeriodicTask], last: dict[str, datetime | None], now: datetime
) -> list[dict[str, Any]]:
    """What ``sa-taskqueue schedules`` shows of each periodic task, one dict each (ISO times)."""
    rows = []
    for entry in periodic:
        schedule = entry.schedule
        upcoming = schedule.next_slot(now)
        rows.append(
            {
                "name": entry.name,
                "cron": schedule.cron,
                "every_seconds": None if schedule.every is None else schedule.every.total_seconds(),
                "tz": schedule.tz.key,
                "next_run": in_zone(upcoming, schedule.tz),
                "next_run_utc": in_zone(upcoming, UTC),
                "last_slot": in_zone(last.get(entry.name), UTC),
            }
        )
    return rows


def next_wake(periodic: Sequence[PeriodicTask], now: datetime) -> datetime | None:
    """The earliest next slot of any schedule after ``now``."""
    slots = [slot for entry in periodic if (slot := entry.schedule.next_slot(now)) is not None]
    return min(slots, default=None)


def run_ticker(
    queue: ScheduleSource,
    stopped: threading.Event,
    poll_interval: float,
    enqueued: Callable[[], None],
) -> None:
    """A worker's schedule thread: tick now, then at every slot boundary and at least every ``poll_interval``.

    Its transactions are its own, on connections the claim is not using, so
    a slow tick never delays a claim; an error is logged and the next tick
    tries again.  ``enqueued`` is called after a tick that enqueued something
    (the worker then claims at once).
    """
    while not stopped.is_set():
        periodic = queue.periodic_tasks
        try:
            if queue.enqueue_due_schedules():
                enqueued()
        except DatabaseUnavailable as error:
            # The claim loop says so once; the next tick after the outage catches up.
            logger.debug("periodic tasks not checked, the database is unavailable: %s", error)
        except Exception:
            logger.exception("enqueueing periodic tasks failed; trying again in %.1fs", poll_interval)
        now = queue.clock()
        wake = next_wake(periodic, now)
        delay = poll_interval
        if wake is not None:
            delay = min(delay, max((wake - now).total_seconds(), 0.0) + 0.001)
        stopped.wait(delay)


class ScheduleService:
    """A worker's schedule `Service`: `run_ticker` in a thread of its own, so a tick never delays a claim."""

    name = "schedules"

    def __init__(self, source: ScheduleSource, poll_interval: float, enqueued: Callable[[], None]) -> None:
        self._source = source
        self._poll_interval = poll_interval
        self._enqueued = enqueued

    def run(self, stopping: threading.Event) -> None:
        run_ticker(self._source, stopping, self._poll_interval, self._enqueued)

    def interrupt(self) -> None:
        """Nothing to interrupt: the ticker's waits watch the stop."""


def _iso(value: datetime | None) -> str:
    return "none" if value is None else value.isoformat()


def in_zone(value: datetime | None, zone: tzinfo) -> str:
    """``value`` shown in ``zone`` (ISO), or ``-``."""
    return "-" if value is None else value.astimezone(zone).isoformat()


__all__ = [
    "EPOCH",
    "EnqueuedSlot",
    "PeriodicTask",
    "Schedule",
    "ScheduleService",
    "ScheduleSource",
    "Schedules",
    "advance_statement",
    "last_slots",
    "next_wake",
    "report",
    "run_ticker",
    "slot_key",
]
