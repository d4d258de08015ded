"""Where the benchmarks run: the same URLs (and variables) as the test suite."""

from __future__ import annotations

import os
from dataclasses import dataclass

import sqlalchemy as sa

DEFAULT_URLS = {
    "postgres": "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/test",
    "sqlite": "sqlite:///benchmarks/results/bench.db",
}


@dataclass(frozen=True)
class BenchBackend:
    name: str
    url: str

    @property
    def dialect(self) -> str:
        return sa.make_url(self.url).get_backend_name()


def backend(name: str) -> BenchBackend:
    env = f"SA_TASKQUEUE_BENCH_{name.upper()}_URL"
    return BenchBackend(name, os.environ.get(env) or DEFAULT_URLS[name])


#: The asyncio driver each backend's async rows go through (psycopg 3 is both).
ASYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "aiomysql", "mariadb": "aiomysql", "sqlite": "aiosqlite"}


def async_url(url: str, driver: str | None = None) -> str:
    """``url`` through an asyncio driver: ``driver``, else the backend's in ASYNC_DRIVERS."""
    parsed = sa.make_url(url)
    backend_name = parsed.get_backend_name()
    chosen = driver or ASYNC_DRIVERS[backend_name]
    return parsed.set(drivername=f"{backend_name}+{chosen}").render_as_string(hide_password=False)


def fresh_table(url: str) -> None:
    """Drop and create the library's table (the benchmarks own the database they are pointed at)."""
    import sa_taskqueue as tq

    engine = sa.create_engine(url)
    tq.metadata.drop_all(engine)
    tq.metadata.create_all(engine)
    engine.dispose()


def analyze(url: str) -> None:
    """Bring the planner's statistics on the library's table up to date, as autovacuum would in time."""
    engine = sa.create_engine(url)
    name = engine.dialect.name
    statement = {"postgresql": "ANALYZE sa_taskqueue_task", "sqlite": "ANALYZE"}.get(
        name, "ANALYZE TABLE sa_taskqueue_task"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(statement)
    engine.dispose()
