"""One conformance suite, every backend.

``pytest --backend postgres`` (or ``SA_TASKQUEUE_TEST_BACKEND``) picks the
database; each nox session passes its own.  Tests taking ``strategy_name``
run once per strategy that backend supports.  A test that needs a capability
(``@pytest.mark.requires("advisory_locks")``) is deselected where the
database's backend lacks it, and the run's summary says which and why.  A
test about one database's own behaviour (an error code, a planner's habit)
is marked ``@pytest.mark.backends(...)`` and deselected elsewhere.

``--async-driver NAME`` (or ``SA_TASKQUEUE_TEST_ASYNC_DRIVER``) runs the same
suite with every test application queue on an `AsyncEngine` of that driver
(``aiosqlite``, ``psycopg``, ``asyncpg``, ``aiomysql``, ``asyncmy``): the
claims, workers and worker processes then go through the async path, while
the tests read and write their rows with the sync engine as before.  Tests
about the async path itself live in ``tests/test_async_*.py``, marked
``async_path``; they pick a driver of their own when none is given.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from sa_taskqueue.backends import Backend as DatabaseBackend
from sa_taskqueue.backends import backend_for
from tests.app import ASYNC_DRIVER_VARIABLE, AppBase, make_engine, make_queue
from tests.backends import ASYNC_DRIVERS, LACKS, STRATEGIES, Backend, Unavailable, provision
from tests.helpers import MovableClock
from tests.link import Link

BACKENDS = sorted(STRATEGIES)

#: How each suite backend is reached, for asking its capabilities before any connect.
URL_FORMS = {
    "sqlite": "sqlite://",
    "postgres": "postgresql+psycopg://",
    "postgres18": "postgresql+psycopg://",
    "mysql": "mysql+pymysql://",
    "mariadb": "mariadb+pymysql://",
    "galera": "mariadb+pymysql://",
    "oracle": "oracle+oracledb://",
}


def database_backend(name: str) -> DatabaseBackend:
    """The package's backend for suite backend ``name`` (capabilities that need no server version)."""
    return backend_for(sa.create_engine(URL_FORMS[name]).dialect)


def family(name: str) -> str:
    """The database a suite backend is: ``postgres18`` is PostgreSQL like ``postgres``; ``galera`` MariaDB."""
    if name == "galera":
        return "mariadb"
    return "postgres" if name.startswith("postgres") else name


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("SA_TASKQUEUE_TEST_BACKEND", "sqlite"),
        choices=BACKENDS,
        help="the database to run the suite against",
    )
    parser.addoption(
        "--async-driver",
        default=os.environ.get(ASYNC_DRIVER_VARIABLE) or None,
        choices=sorted({driver for drivers in ASYNC_DRIVERS.values() for driver in drivers}),
        help="run the test application's queues on an AsyncEngine of this driver",
    )
    parser.addoption(
        "--strategy",
        action="append",
        default=None,
        metavar="NAME",
        help="run the tests taking a strategy on this one only (repeatable; default: all the backend has)",
    )


def pytest_configure(config: pytest.Config) -> None:
    backend = config.getoption("--backend")
    driver = config.getoption("--async-driver")
    if driver is not None:
        if driver not in ASYNC_DRIVERS[backend]:
            known = ", ".join(ASYNC_DRIVERS[backend]) or "none"
            raise pytest.UsageError(f"--async-driver {driver} does not reach {backend} (drivers: {known})")
        # Worker processes the tests start (tests.app, the command line) read it too.
        os.environ[ASYNC_DRIVER_VARIABLE] = driver
    else:
        os.environ.pop(ASYNC_DRIVER_VARIABLE, None)
    config.addinivalue_line("markers", "backends(*names): about these databases' own behaviour")
    config.addinivalue_line("markers", "requires(*capabilities): needs these capabilities of the backend")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy_name" in metafunc.fixturenames:
        backend = metafunc.config.getoption("--backend")
        strategies = STRATEGIES[backend]
        chosen: list[str] | None = metafunc.config.getoption("--strategy")
        if chosen:
            unknown = sorted(set(chosen) - set(strategies))
            if unknown:
                raise pytest.UsageError(
                    f"--strategy {', '.join(unknown)}: not a strategy of {backend} ({', '.join(strategies)})"
                )
            strategies = [strategy for strategy in strategies if strategy in chosen]
        metafunc.parametrize("strategy_name", strategies)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = config.getoption("--backend")
    database = database_backend(name)
    keep, drop = [], []
    reasons: Counter[str] = Counter()
    for item in items:
        reason = _why_not_here(item, name, database)
        if reason is None:
            keep.append(item)
        else:
            drop.append(item)
            reasons[reason] += 1
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    config.stash[DESELECTED] = dict(reasons)


def _why_not_here(item: pytest.Item, name: str, database: DatabaseBackend) -> str | None:
    about = item.get_closest_marker("backends")
    if about is not None and family(name) not in about.args and name not in about.args:
        return f"about {', '.join(about.args)} only"
    needs = item.get_closest_marker("requires")
    wanted = needs.args if needs is not None else ()
    lacks = LACKS.get(name, {})
    missing = [
        capability for capability in wanted if not getattr(database, capability) or capability in lacks
    ]
    if missing:
        why = "; ".join(lacks[capability] for capability in missing if capability in lacks)
        return f"{database.label} has no {' or '.join(missing)}" + (f" ({why})" if why else "")
    return None


DESELECTED = pytest.StashKey[dict[str, int]]()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    reasons = config.stash.get(DESELECTED, {})
    if reasons:
        driver = config.getoption("--async-driver")
        through = f" through {driver}" if driver else ""
        terminalreporter.section(f"deselected on {config.getoption('--backend')}{through}")
        for reason, count in sorted(reasons.items()):
            terminalreporter.line(f"{count} test(s): {reason}")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backend]:
    name = request.config.getoption("--backend")
    try:
        with provision(name, str(tmp_path_factory.mktemp("db"))) as found:
            yield found
    except Unavailable as error:
        pytest.exit(str(error), returncode=3)


@pytest.fixture(scope="session")
def engine(backend: Backend) -> Iterator[sa.Engine]:
    engine = make_engine(backend.url)
    for metadata in (tq.metadata, AppBase.metadata):
        metadata.drop_all(engine)
        metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture(autouse=True)
def clean_tables(request: pytest.FixtureRequest) -> None:
    """Every test starts with empty tables (when it touches the database at all)."""
    if "engine" not in request.fixturenames:
        return
    engine: sa.Engine = request.getfixturevalue("engine")
    with engine.begin() as conn:
        for metadata in (tq.metadata, AppBase.metadata):
            for table in metadata.sorted_tables:
                conn.execute(table.delete())


@pytest.fixture
def lease() -> timedelta:
    return timedelta(minutes=5)


@pytest.fixture
def queue(engine: sa.Engine, strategy_name: str, lease: timedelta) -> Iterator[tq.TaskQueue]:
    queue = make_queue(engine, strategy_name, lease)
    yield queue
    queue.close()


@pytest.fixture
def clock() -> MovableClock:
    return MovableClock()


@pytest.fixture
def clocked_queue(
    engine: sa.Engine, strategy_name: str, lease: timedelta, clock: MovableClock
) -> Iterator[tq.TaskQueue]:
    """The test application's queue on ``clock``: time passes for it only when the test moves the clock."""
    queue = make_queue(engine, strategy_name, lease, clock.now)
    yield queue
    queue.close()


@pytest.fixture
def default_queue(engine: sa.Engine, lease: timedelta) -> Iterator[tq.TaskQueue]:
    """The test application's queue on the strategy the registry picks, for tests of the runtime."""
    queue = make_queue(engine, None, lease)
    yield queue
    queue.close()


@pytest.fixture
def session(engine: sa.Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session


@pytest.fixture
def link(backend: Backend) -> Iterator[Link]:
    """A loopback link to the backend's server that the test can cut (tests.link)."""
    server = sa.make_url(backend.url)
    link = Link(server.host or "127.0.0.1", server.port or 0)
    yield link
    link.close()
