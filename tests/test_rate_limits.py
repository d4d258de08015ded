"""Rate limits: never more than N starts per key in any window, across workers, processes and claims."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import mysql, oracle, postgresql, sqlite
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.core.rate_limit import (
    BUCKETS,
    EMPTY,
    RateLimit,
    RateWindow,
    decode,
    encode,
    micros,
    plan_starts,
)
from sa_taskqueue.core.rate_limit_table import rate_limit_table_of
from sa_taskqueue.strategies.claiming import ClaimRequest, due_select, read_back
from sa_taskqueue.strategies.rated import take_statement
from sa_taskqueue.strategies.skip_locked import SkipLockedStrategy
from tests.backends import Backend
from tests.helpers import MovableClock, wait_until
from tests.rated_app import LIMIT, WINDOW, make_rated_queue, most_in_a_window, reset, starts

ROOT = Path(__file__).resolve().parent.parent
TABLE = tq.Task.__table__
RATES = rate_limit_table_of(TABLE)
NOW = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock(NOW)


def enqueue(queue: tq.TaskQueue, engine: sa.Engine, keys: list[str], name: str = "rated") -> list[int]:
    with Session(engine) as session:
        ids = [queue.enqueue(session, name, {"key": key, "n": n}).id for n, key in enumerate(keys)]
        session.commit()
    return ids


# The race --------------------------------------------------------------------------------


def race(backend: Backend, engine: sa.Engine, strategy_name: str, tmp_path: Path, limit: int) -> None:
    """Three worker processes of four threads each over 4 keys x 12 tasks: each start as the tasks saw it."""
    reset(engine)
    keys = [f"k{n}" for n in range(4)]
    queue = make_rated_queue(engine, strategy_name)
    with Session(engine) as session:
        queue.enqueue_many(session, "rated", ({"key": keys[n % 4], "n": n} for n in range(48)))
        session.commit()
    queue.close()
    procs = []
    for n in range(3):
        args = ["--url", backend.url, "--strategy", strategy_name, "--limit", str(limit)]
        args += ["--ready", str(tmp_path / f"ready-{n}"), "--go", str(tmp_path / "go")]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.rated_app", *args],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        wait_until(lambda: all((tmp_path / f"ready-{n}").exists() for n in range(3)), 120, "the workers")
        (tmp_path / "go").touch()
        outputs = [proc.communicate(timeout=120) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for proc, (_out, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err
        assert "Traceback" not in err, err


def claimed_starts(engine: sa.Engine) -> dict[int, float]:
    """Each run's start as the claim wrote it (``started_at``), by its number."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(tq.Task.params, tq.Task.started_at).where(tq.Task.name == "rated")
        ).all()
    return {params["n"]: started.timestamp() for params, started in rows}


def peaks(engine: sa.Engine, *, limited: bool) -> tuple[int, int]:
    """The most starts of one key in any window of WINDOW: by the claims' times, and by the tasks' own.

    With the limit, the tasks' own clocks see each start a little after its
    claim: a window of WINDOW less the spread of that delay holds no more
    than one of WINDOW of the claims' times, so that is the window counted.
    """
    seen = starts(engine)
    assert sorted(n for n, _, _ in seen) == list(range(48)), "every task ran, once"
    claimed = claimed_starts(engine)
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for n, key, at in seen:
        by_key[key].append((claimed[n], at))
    window = WINDOW
    if limited:
        delays = [at - claim for pairs in by_key.values() for claim, at in pairs]
        spread = max(delays) - min(delays)
        assert spread < WINDOW * 0.8, f"the runs began too long after their claims to tell: {spread:.3f}s"
        window = WINDOW - spread
    by_claim = max(most_in_a_window([claim for claim, _ in pairs], WINDOW) for pairs in by_key.values())
    by_task = max(most_in_a_window([at for _, at in pairs], window) for pairs in by_key.values())
    return by_claim, by_task


def test_racing_worker_processes_never_start_more_than_the_limit_in_any_window(
    backend: Backend, engine: sa.Engine, strategy_name: str, tmp_path: Path
) -> None:
    race(backend, engine, strategy_name, tmp_path, LIMIT)
    by_claim, by_task = peaks(engine, limited=True)
    assert by_claim <= LIMIT, f"{by_claim} starts of a key in {WINDOW}s (claims' times), limit {LIMIT}"
    assert by_task <= LIMIT, f"{by_task} starts of a key in a window (tasks' times), limit {LIMIT}"
    assert by_claim == LIMIT, "the workers really raced for the limit"


def test_the_race_counts_more_than_the_limit_without_it(
    backend: Backend, engine: sa.Engine, tmp_path: Path
) -> None:
    # The self-check: the same counting over the same race with no limit finds
    # more.  (Once per backend: with no limit, the strategies claim alike.)
    race(backend, engine, backend.strategies[0], tmp_path, 0)
    by_claim, by_task = peaks(engine, limited=False)
    assert by_claim > LIMIT and by_task > LIMIT, (by_claim, by_task)


# The claim -------------------------------------------------------------------------------------


@pytest.fixture
def rated_queue(engine: sa.Engine, strategy_name: str, clock: MovableClock) -> Iterator[tq.TaskQueue]:
    reset(engine)
    queue = make_rated_queue(engine, strategy_name, clock.now, limit="3/s")
    yield queue
    queue.close()


def test_a_claim_starts_at_most_the_limit_per_key_and_the_window_lets_more_start_later(
    engine: sa.Engine, rated_queue: tq.TaskQueue, clock: MovableClock
) -> None:
    enqueue(rated_queue, engine, ["a"] * 5 + ["b"] * 2)
    claimed = rated_queue.claim(limit=20)
    assert Counter(task.params["key"] for task in claimed) == {"a": 3, "b": 2}
    assert rated_queue.claim(limit=20) == [], "key a has used its window"
    clock.advance(timedelta(seconds=0.5))
    assert rated_queue.claim(limit=20) == []
    # The starts' bucket leaves the window a second and at most a tenth after them.
    clock.advance(timedelta(seconds=0.6))
    assert Counter(task.params["key"] for task in rated_queue.claim(limit=20)) == {"a": 2}
    with engine.connect() as conn:
        rows = conn.execute(sa.select(RATES.c.name, RATES.c.rate_window, RATES.c.rate_key)).all()
    assert sorted(rows) == [("rated", "3/1s", 'rated:"a"'), ("rated", "3/1s", 'rated:"b"')]


def test_tasks_over_their_limit_do_not_hold_up_the_tasks_behind_them(
    engine: sa.Engine, rated_queue: tq.TaskQueue, clock: MovableClock
) -> None:
    enqueue(rated_queue, engine, ["a"] * 10)
    with Session(engine) as session:
        late_b = rated_queue.enqueue(session, "rated", {"key": "b", "n": 10}).id
        plain = rated_queue.enqueue(session, "plain", {"n": 11}).id
        session.commit()
    # One at a time: after a's three, its other seven are passed over.
    taken = [task.id for _ in range(5) for task in rated_queue.claim(limit=1)]
    assert len(taken) == 5 and late_b in taken and plain in taken
    assert rated_queue.claim(limit=1) == []
    with engine.connect() as conn:
        held = (
            conn.execute(sa.select(tq.Task.run_at).where(tq.Task.status == tq.TaskStatus.QUEUED))
            .scalars()
            .all()
        )
    assert len(held) == 7 and all(NOW < run_at <= NOW + timedelta(seconds=1.1) for run_at in held)
    clock.advance(timedelta(seconds=1.1))
    assert len(rated_queue.claim(limit=20)) == 3


def test_several_windows_at_once_each_hold(
    engine: sa.Engine, strategy_name: str, clock: MovableClock
) -> None:
    reset(engine)
    queue = make_rated_queue(engine, strategy_name, clock.now, limit=("3/s", "5/10s"))
    try:
        enqueue(queue, engine, ["a"] * 12)
        assert len(queue.claim(limit=20)) == 3, "3 in a second"
        clock.advance(timedelta(seconds=1.1))
        assert len(queue.claim(limit=20)) == 2, "and 5 in ten seconds"
        clock.advance(timedelta(seconds=1.1))
        assert queue.claim(limit=20) == []
        clock.advance(timedelta(seconds=9))
        assert len(queue.claim(limit=20)) == 3
    finally:
        queue.close()


def test_a_worker_runs_rate_limited_tasks_as_their_window_allows(
    engine: sa.Engine, strategy_name: str
) -> None:
    reset(engine)
    queue = make_rated_queue(engine, strategy_name, limit="4/s")
    try:
        enqueue(queue, engine, ["a"] * 6)
        worker = tq.Worker(queue, concurrency=2, poll_interval=0.05, listen=False, watchdog=False)
        import threading

        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        wait_until(lambda: len(starts(engine)) == 6, 10, "the rate-limited tasks to run")
        worker.stop()
        thread.join(10)
    finally:
        queue.close()
    times = sorted(at for _, _, at in starts(engine))
    assert most_in_a_window(times, 1.0 - 0.2) <= 4
    assert times[-1] - times[0] >= 0.9, "the last two waited for the window"


# Declaring -------------------------------------------------------------------------------------


def f(key: str, n: int) -> None:
    pass


@pytest.mark.parametrize(
    ("limit", "key", "error", "message"),
    [
        ("100", None, ValueError, "not of the form"),
        ("100/week", None, ValueError, "not of the form"),
        ("0/s", None, ValueError, "count must be between"),
        ("5/2d", None, ValueError, "window must be between"),
        (100, None, TypeError, "must be a string"),
        (("1/s", "5/s"), None, ValueError, "two limits for one window"),
        ("1/s", "nope", ValueError, "rate_key names params"),
        ("1/s", 5, TypeError, "rate_key must be"),
    ],
)
def test_bad_rate_limits_are_refused_with_the_reason(
    limit: object, key: object, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        RateLimit.of("t", f, limit, key)


def test_the_options_are_checked_at_registration(engine: sa.Engine) -> None:
    queue = tq.TaskQueue(engine)
    with pytest.raises(ValueError, match="rate_key needs a rate_limit"):
        queue.task(name="x", rate_key="key")
    with pytest.raises(ValueError, match="not both"):
        queue.task(name="x", rate_limit="1/s", concurrency_limit=1)
    registered = queue.task(name="ok", rate_limit=("10/s", "500/h", "5/10m"), rate_key=("key", "n"))(f)
    assert registered.options.rate is not None
    assert [w.label for w in registered.options.rate.windows] == ["10/1s", "500/3600s", "5/600s"]
    queue.close()


# The scheme ------------------------------------------------------------------------------------


def test_no_sequence_of_starts_puts_more_than_n_in_any_window() -> None:
    # Starts as dense as the scheme allows, from many offsets: never N + 1
    # in a closed window of W, and the next start is never later than W + W/BUCKETS.
    window = RateWindow(7, 2)
    for offset in range(0, 2_000_000, 37_123):
        state = EMPTY
        times: list[int] = []
        now = offset
        while len(times) < 60:
            if state.allows(window, now):
                state = decode(encode(state.with_start(window, now)))
                times.append(now)
            else:
                later = state.next_allowed_us(window, now)
                assert later > now and state.allows(window, later) and not state.allows(window, later - 1)
                now = later
            now += 13_001 * (len(times) % 3)
        assert most_in_a_window([t / 1e6 for t in times], 2.0) <= 7
        gaps = [times[i + 7] - times[i] for i in range(len(times) - 7)]
        assert min(gaps) > 2_000_000 and max(gaps) <= 2_000_000 + 2_000_000 // BUCKETS + 3 * 13_001


def test_plan_starts_in_claim_order_and_tells_when_the_held_may_start() -> None:
    window = RateWindow(2, 1)
    now = micros(NOW)
    started, changed, held = plan_starts(
        [(1, [("a", window)]), (2, [("a", window)]), (3, [("a", window)]), (4, [("b", window)])], {}, now, 10
    )
    assert started == [1, 2, 4] and set(changed) == {"a", "b"}
    assert held == {3: (now // 100_000 + 1) * 100_000 + 1_000_000}


# The SQL, on every dialect ------------------------------------------------------------------------


def compiled(statement: object, dialect: sa.engine.Dialect) -> str:
    return " ".join(str(statement.compile(dialect=dialect)).split())  # type: ignore[attr-defined]


REQUEST = ClaimRequest(
    limit=4, queues=None, worker_id="w", now=NOW, lease_until=NOW + timedelta(minutes=5), names=("rated",)
)


@pytest.mark.parametrize(
    "dialect", [oracle.dialect(), mysql.dialect(), postgresql.dialect(), sqlite.dialect()]
)
def test_the_rated_claims_sql_compiles_on_every_dialect(dialect: sa.engine.Dialect) -> None:
    take = compiled(take_statement(TABLE, REQUEST, 2), dialect)
    assert take.startswith("UPDATE sa_taskqueue_task SET") and "RETURNING" not in take
    assert take.count("attempts =") >= 2, "each row fenced on its own attempt seen"
    swap = compiled(
        sa.update(RATES).where(RATES.c.id == "x", RATES.c.version == 3).values(state="1:1", version=4),
        dialect,
    )
    assert "WHERE sa_taskqueue_task_rate_limits.id =" in swap
    assert "AND sa_taskqueue_task_rate_limits.version =" in swap
    ddl = str(sa.schema.CreateTable(RATES).compile(dialect=dialect))
    assert "PRIMARY KEY (id)" in ddl


def test_oracle_locks_rated_candidates_from_an_unbounded_cursor() -> None:
    query = SkipLockedStrategy().limited_candidates(
        oracle.dialect(), due_select(TABLE, REQUEST, *read_back(TABLE)), REQUEST
    )
    text = compiled(query, oracle.dialect())
    assert text.endswith("FOR UPDATE SKIP LOCKED"), text
    assert "FETCH FIRST" not in text and "ROWNUM" not in text, "ORA-02014 with FOR UPDATE"
    ddl = " ".join(str(sa.schema.CreateTable(RATES).compile(dialect=oracle.dialect())).split())
    assert "version NUMBER(19) NOT NULL" in ddl and "rate_window VARCHAR2(32 CHAR)" in ddl, ddl
