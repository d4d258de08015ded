"""Periodic tasks: each slot enqueued once however many processes tick, cron in a time zone, the CLI.

The race: real processes tick at the same injected times, released together
by a barrier, over several slots and a "downtime"; every slot must be
enqueued by exactly one of them, and of the slots missed while down only the
latest.
"""

from __future__ import annotations

import json
import multiprocessing
import signal
from collections import Counter
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

import sa_taskqueue as tq
from sa_taskqueue.cli.main import cli
from sa_taskqueue.core.control import SCHEDULE, control_table_of
from sa_taskqueue.features.schedules import Schedule, advance_statement
from tests.backends import Backend
from tests.helpers import MovableClock, start_cli, task_rows, wait_until
from tests.periodic_app import CRON_5, EVERY_5, executions, register_five_minutes, tick_rounds

PARIS = ZoneInfo("Europe/Paris")
PROCESSES = 8


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# The race ----------------------------------------------------------------------------


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_racing_processes_enqueue_each_slot_once_and_only_the_latest_after_downtime(
    backend: Backend, engine: sa.Engine
) -> None:
    rounds = [
        "2026-03-10T10:02:00+00:00",  # first sighting: 10:00 recorded, not run
        "2026-03-10T10:05:00+00:00",  # 10:05, at the boundary itself
        "2026-03-10T10:07:30+00:00",  # still 10:05: nothing
        "2026-03-10T10:10:00.500000+00:00",  # 10:10
        "2026-03-10T10:31:00+00:00",  # down since: 10:15 to 10:25 skipped, 10:30 runs
        "2026-03-10T10:35:00+00:00",  # 10:35
    ]
    expected = [utc(f"2026-03-10T10:{minute}:00") for minute in ("05", "10", "30", "35")]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=tick_rounds, args=(backend.url, rounds, barrier, results))
        for _ in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    reported = [results.get(timeout=120) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    # The process that failed first, not those it stopped at the barrier.
    errors = sorted(
        (error for _, _, error in reported if error is not None), key=lambda e: "BrokenBarrier" in e
    )
    assert not errors, errors[0]
    enqueued = Counter((name, slot) for _, mine, _ in reported for _, name, slot in mine)
    for name in (EVERY_5, CRON_5):
        slots = sorted(utc_slot for (task, utc_slot) in enqueued if task == name)
        assert slots == [slot.isoformat() for slot in expected], name
    assert set(enqueued.values()) == {1}, f"a slot enqueued twice: {enqueued}"
    # The same in the table: one task per slot, due at its slot, keyed by it.
    rows = task_rows(engine)
    assert sorted((row.name, row.run_at, row.unique_key) for row in rows) == sorted(
        (name, slot, slot.isoformat()) for name in (EVERY_5, CRON_5) for slot in expected
    )
    assert {row.name: row.params for row in rows} == {EVERY_5: {}, CRON_5: {"note": "cron"}}
    controls = control_table_of(tq.Task.__table__)
    with engine.connect() as conn:
        last = dict(conn.execute(sa.select(controls.c.name, controls.c.last_slot)).all())
    assert last == {EVERY_5: expected[-1], CRON_5: expected[-1]}


# Cron in a time zone -------------------------------------------------------------------


def test_cron_slots_follow_the_zone_across_daylight_saving_changes() -> None:
    nightly = Schedule.of("30 2 * * *", None, "Europe/Paris")
    # Spring forward (2026-03-29, 02:00 CET -> 03:00 CEST): 02:30 does not
    # exist that night; cronsim (like Debian cron) runs it at 03:00 CEST.
    slot = nightly.next_slot(utc("2026-03-28T12:00:00"))
    assert slot == utc("2026-03-29T01:00:00")
    assert slot.astimezone(PARIS).isoformat() == "2026-03-29T03:00:00+02:00"
    assert nightly.next_slot(slot) == utc("2026-03-30T00:30:00")  # 02:30 CEST
    assert nightly.latest_slot(utc("2026-03-29T01:00:59")) == slot
    assert nightly.latest_slot(utc("2026-03-29T00:59:59")) == utc("2026-03-28T01:30:00")  # 02:30 CET
    # Fall back (2026-10-25, 03:00 CEST -> 02:00 CET): 02:30 happens twice; it runs once, the first time.
    assert nightly.next_slot(utc("2026-10-24T12:00:00")) == utc("2026-10-25T00:30:00")
    assert nightly.next_slot(utc("2026-10-25T00:30:00")) == utc("2026-10-26T01:30:00")
    # In the repeated hour (02:15 CET, after 02:30 CEST) the latest slot is the one that passed.
    assert nightly.latest_slot(utc("2026-10-25T01:15:00")) == utc("2026-10-25T00:30:00")
    # An hourly job runs every real hour, the repeated hour too.
    hourly = Schedule.of("0 * * * *", None, PARIS)
    now, slots = utc("2026-10-24T22:30:00"), []
    for _ in range(4):
        next_slot = hourly.next_slot(now)
        assert next_slot is not None
        slots.append(next_slot)
        now = next_slot
    utc_hours = ["2026-10-24T23", "2026-10-25T00", "2026-10-25T01", "2026-10-25T02"]
    assert slots == [utc(f"{hour}:00:00") for hour in utc_hours]
    in_paris = [slot.astimezone(PARIS).strftime("%H%z") for slot in slots]
    assert in_paris == ["01+0200", "02+0200", "02+0100", "03+0100"]
    # Intervals count from the epoch, whatever the zone.
    every = Schedule.of(None, timedelta(minutes=7), "Europe/Paris")
    assert every.latest_slot(utc("1970-01-01T00:20:00")) == utc("1970-01-01T00:14:00")
    assert every.next_slot(utc("1970-01-01T00:14:00")) == utc("1970-01-01T00:21:00")


def test_a_tick_on_the_spring_forward_night_enqueues_the_shifted_slot(engine: sa.Engine) -> None:
    clock = MovableClock(utc("2026-03-28T23:00:00"))
    queue = tq.TaskQueue(engine, clock=clock.now)

    @queue.periodic("30 2 * * *", tz=PARIS, name="nightly")
    def nightly() -> None:
        pass

    assert queue.enqueue_due_schedules() == []  # first sighting: 02:30 CET on the 28th recorded
    clock.advance(timedelta(hours=1, minutes=59))  # 00:59Z, 01:59 CET
    assert queue.enqueue_due_schedules() == []
    clock.advance(timedelta(minutes=1))  # 01:00Z: 03:00 CEST, the slot of 02:30
    [done] = queue.enqueue_due_schedules()
    assert done.slot == utc("2026-03-29T01:00:00")
    [row] = task_rows(engine)
    assert (row.name, row.run_at, row.unique_key) == ("nightly", done.slot, "2026-03-29T01:00:00+00:00")
    assert queue.enqueue_due_schedules() == []


def test_the_slot_s_update_compiles_for_oracle() -> None:
    """Oracle is not live: its statement is checked compiled (a bare comparison, nothing dialect-specific)."""
    from sqlalchemy.dialects import oracle

    controls = control_table_of(tq.Task.__table__)
    slot = utc("2026-03-10T10:05:00")
    sql = str(advance_statement(controls, "job", slot, slot).compile(dialect=oracle.dialect()))
    assert sql.startswith("UPDATE sa_taskqueue_task_control SET last_slot=")
    assert (
        "WHERE sa_taskqueue_task_control.kind = :kind_1 AND sa_taskqueue_task_control.name = :name_1" in sql
    )
    assert (
        "(sa_taskqueue_task_control.last_slot IS NULL OR sa_taskqueue_task_control.last_slot < :last_slot_1)"
        in sql
    )


# A worker ---------------------------------------------------------------------------------


@pytest.mark.slow  # starts processes: run in each backend's full session
def test_a_worker_process_enqueues_and_runs_its_periodic_tasks(backend: Backend, engine: sa.Engine) -> None:
    worker = start_cli("worker", "tests.periodic_app:cli_queue", "--poll-interval", "0.2", url=backend.url)
    try:
        # The first second is recorded, not run; each one after runs once.
        wait_until(lambda: len(executions(engine)) >= 2, 30, "two runs of the every-second task")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.communicate(timeout=30)
    rows = [row for row in task_rows(engine) if row.name == "tick_every_second"]
    keys = [row.unique_key for row in rows]
    assert len(keys) == len(set(keys)) >= 2
    assert all(row.run_at is not None and row.run_at.microsecond == 0 for row in rows)


# The command line ------------------------------------------------------------------------


def test_schedules_lists_each_periodic_task_with_its_next_and_last_slot(
    backend: Backend, engine: sa.Engine
) -> None:
    controls = control_table_of(tq.Task.__table__)
    last = utc("2026-03-10T01:30:00")
    with engine.begin() as conn:
        conn.execute(
            sa.insert(controls).values(kind=SCHEDULE, name="nightly_paris", last_slot=last, updated_at=last)
        )
    runner = CliRunner()
    env = {"SA_TASKQUEUE_DATABASE_URL": backend.url, "COLUMNS": "200"}
    result = runner.invoke(cli, ["schedules", "--app", "tests.periodic_app:cli_queue", "--json"], env=env)
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.output)}
    assert set(rows) == {"nightly_paris", "tick_every_second"}
    nightly = rows["nightly_paris"]
    assert (nightly["cron"], nightly["tz"]) == ("30 2 * * *", "Europe/Paris")
    assert nightly["last_slot"] == last.isoformat()
    next_run = datetime.fromisoformat(nightly["next_run"])
    assert next_run.astimezone(PARIS).strftime("%H:%M") == "02:30" or next_run.strftime("%H:%M") == "03:00"
    assert datetime.fromisoformat(nightly["next_run_utc"]) == next_run
    assert (rows["tick_every_second"]["every_seconds"], rows["tick_every_second"]["last_slot"]) == (1.0, "-")

    text = runner.invoke(cli, ["schedules", "tests.periodic_app:cli_queue"], env=env)
    assert text.exit_code == 0, text.output
    assert 'cron "30 2 * * *"' in text.output and "Europe/Paris" in text.output
    assert "every 0:00:01" in text.output and last.isoformat() in text.output

    missing = runner.invoke(cli, ["schedules"], env=env)
    assert missing.exit_code == 2 and "give APP or --app" in missing.output


# Bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "message"),
    [
        (("61 * * * *",), {}, ValueError, "cron: '61 * * * *' is not a cron expression"),
        (("* * *",), {}, ValueError, "is not a cron expression"),
        ((5,), {}, TypeError, "cron must be a cron expression string"),
        (("* * * * *",), {"tz": "Mars/Olympus"}, ValueError, "tz: unknown time zone 'Mars/Olympus'"),
        (("* * * * *",), {"tz": 1}, TypeError, "tz must be an IANA time zone name"),
        ((), {"every": timedelta(0)}, ValueError, "every must be a positive timedelta"),
        ((), {"every": 60}, TypeError, "every must be a timedelta"),
        ((), {}, TypeError, "exactly one of cron"),
        (("* * * * *",), {"every": timedelta(minutes=1)}, TypeError, "exactly one of cron"),
        (("* * * * *",), {"params": {"other": 1}}, TypeError, "params do not fit periodic task"),
        (("* * * * *",), {"params": [1]}, TypeError, "params"),
    ],
)
def test_bad_schedules_are_refused_when_decorating(
    args: tuple[object, ...], kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    queue = tq.TaskQueue(sa.create_engine("sqlite://"))

    def job(key: int = 0) -> None:
        pass

    with pytest.raises(error, match=message.replace("*", r"\*").replace("(", r"\(")):
        queue.periodic(*args, **kwargs)(job)  # type: ignore[arg-type]
    assert queue.periodic_tasks == [] and queue.task_names == []


def test_periodic_takes_the_task_options_and_names(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)
    register_five_minutes(queue)

    @queue.periodic(every=timedelta(hours=1), queue="reports", priority=5, max_attempts=1, timeout=30)
    def hourly_report() -> None:
        pass

    names = [entry.name for entry in queue.periodic_tasks]
    assert names == sorted([CRON_5, EVERY_5, hourly_report.name])
    assert hourly_report.name.endswith("hourly_report")
    assert (hourly_report.options.queue, hourly_report.options.priority, hourly_report.options.timeout) == (
        "reports",
        5,
        30.0,
    )
