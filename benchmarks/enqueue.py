"""Enqueue throughput: one enqueue per call, the bulk API (also through an AsyncSession), and the raw
driver's fastest bulk path (COPY on PostgreSQL, executemany elsewhere)."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.orm import Session

from benchmarks.backends import async_url, fresh_table
from benchmarks.clients import TABLE, noop

COLUMNS = "name, queue, priority, params, status, run_at, attempts, max_attempts, created_at"

#: The PostgreSQL types of COLUMNS, which binary COPY needs named.
COPY_TYPES = ["varchar", "varchar", "int4", "jsonb", "varchar", "timestamptz", "int4", "int4", "timestamptz"]

#: What the raw row runs on each database: the driver's fastest way to write many rows.
RAW_PATHS = {
    "postgresql": "binary COPY",
    "mysql": "executemany",
    "mariadb": "executemany",
    "sqlite": "executemany",
}


def _queue(engine: sa.Engine) -> object:  # an AsyncEngine too
    import sa_taskqueue as tq

    queue = tq.TaskQueue(engine)
    queue.task(name="noop")(noop)
    return queue


def start_clock() -> float:
    """``time.perf_counter()``, after collecting what earlier runs left behind.

    So that no path pays, in its timed window, for a garbage collection set
    off by the objects another path left (the ORM loop leaves thousands).
    """
    gc.collect()
    return time.perf_counter()


def enqueue_rate(method: str, url: str, count: int) -> float:
    """Tasks per second for ``count`` enqueues committed once.

    Every path is connected before its clock starts, as an application's
    pool is: what is timed is the enqueue and its commit, not a connection's
    setup (for a new SQLAlchemy engine, its first connection also reads the
    server's settings, several milliseconds that a running application pays
    once).
    """
    fresh_table(url)
    params = [{"n": n} for n in range(count)]
    if method == "async_enqueue_many":
        seconds = asyncio.run(_async_enqueue_many(url, params))
    elif method == "raw":
        seconds = _raw_bulk(url, params)
    else:
        engine = sa.create_engine(url)
        queue = _queue(engine)
        with Session(engine) as session:
            session.connection()
            started = start_clock()
            if method == "enqueue":
                for p in params:
                    queue.enqueue(session, "noop", p)  # type: ignore[attr-defined]
            elif method == "enqueue_many":
                queue.enqueue_many(session, "noop", params)  # type: ignore[attr-defined]
            else:
                raise ValueError(f"no enqueue method {method!r}")
            session.commit()
            seconds = time.perf_counter() - started
        engine.dispose()
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        stored = conn.scalar(sa.text(f"SELECT count(*) FROM {TABLE}"))
    engine.dispose()
    if stored != count:
        raise RuntimeError(f"{method}: {stored} rows stored for {count} enqueued")
    return count / seconds


async def _async_enqueue_many(url: str, params: list[dict[str, int]]) -> float:
    """Seconds for ``enqueue_many`` through an AsyncSession of the backend's asyncio driver, one call."""
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    engine = create_async_engine(async_url(url))
    queue = _queue(engine)  # type: ignore[arg-type]
    async with AsyncSession(engine) as session:
        await session.connection()
        started = start_clock()
        await queue.enqueue_many(session, "noop", params)  # type: ignore[attr-defined]
        await session.commit()
        seconds = time.perf_counter() - started
    await engine.dispose()
    return seconds


def _raw_bulk(url: str, params: list[dict[str, int]]) -> float:
    """Seconds for the driver's fastest bulk path to write and commit ``params`` as task rows."""
    u = sa.make_url(url)
    now = datetime.now(UTC)
    backend = u.get_backend_name()
    if backend == "postgresql":
        import psycopg
        from psycopg.types.json import Jsonb

        with psycopg.connect(host=u.host, port=u.port or 5432, user=u.username, dbname=u.database) as conn:
            started = start_clock()
            with conn.cursor().copy(f"COPY {TABLE} ({COLUMNS}) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(COPY_TYPES)
                for p in params:
                    copy.write_row(("noop", "default", 0, Jsonb(p), "queued", now, 0, 3, now))
            conn.commit()
            return time.perf_counter() - started
    naive = now.replace(tzinfo=None)
    if backend in ("mysql", "mariadb"):
        import pymysql

        conn = pymysql.connect(
            host=u.host, port=u.port or 3306, user=u.username, password=u.password or "", database=u.database
        )
        started = start_clock()
        rows = [("noop", "default", 0, json.dumps(p), "queued", naive, 0, 3, naive) for p in params]
        with conn.cursor() as cursor:
            cursor.executemany(
                f"INSERT INTO {TABLE} ({COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)", rows
            )
        conn.commit()
        seconds = time.perf_counter() - started
        conn.close()
        return seconds
    import sqlite3

    assert u.database
    conn3 = sqlite3.connect(u.database)
    started = start_clock()
    stamp = naive.isoformat(" ", "microseconds")
    rows_sqlite = [("noop", "default", 0, json.dumps(p), "queued", stamp, 0, 3, stamp) for p in params]
    conn3.executemany(f"INSERT INTO {TABLE} ({COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", rows_sqlite)
    conn3.commit()
    seconds = time.perf_counter() - started
    conn3.close()
    return seconds
