"""One conformance suite, every backend.

``pytest --backend postgres`` (or ``SA_TASKQUEUE_TEST_BACKEND``) picks the
database; each nox session passes its own.  Tests taking ``strategy_name``
run once per strategy that backend supports.  Tests marked
``@pytest.mark.backends(...)`` are about one database's behaviour and are
deselected (not skipped) elsewhere.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import sa_taskqueue as tq
from tests.app import AppBase, make_engine, make_queue
from tests.backends import STRATEGIES, Backend, Unavailable, provision

BACKENDS = sorted(STRATEGIES)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("SA_TASKQUEUE_TEST_BACKEND", "sqlite"),
        choices=BACKENDS,
        help="the database to run the suite against",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "backends(*names): only meaningful on these backends")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "strategy_name" in metafunc.fixturenames:
        backend = metafunc.config.getoption("--backend")
        metafunc.parametrize("strategy_name", STRATEGIES[backend])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backend = config.getoption("--backend")
    keep, drop = [], []
    for item in items:
        marker = item.get_closest_marker("backends")
        (keep if marker is None or backend in marker.args else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
def default_queue(engine: sa.Engine, lease: timedelta) -> Iterator[tq.TaskQueue]:
    """The test application's queue on the strategy the registry picks, for tests of the runtime."""
    queue = make_queue(engine, None, lease)
    yield queue
    queue.close()


@pytest.fixture
def session(engine: sa.Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session
