"""The Python examples of README.md and docs/ run as tests, so they cannot drift from the code.

pytest-markdown-docs turns each ```python fence of README.md and of every
Markdown page under docs/ into a test item (``python notest`` fences are
shown, not run; ``python continuation`` ones run after the fences before them
in the same file, in the same namespace).  Its own switch, ``--markdown-docs``,
would also import every module under tests/ to read docstrings, some of which
fail to import on purpose, so these files alone are collected here:
``pytest README.md docs``.

Each example runs in a fresh temporary directory, so the ``sqlite:///app.db``
an example defaults to is a new file there.  Against another backend
(``pytest --backend postgres``, or ``SA_TASKQUEUE_TEST_BACKEND=postgres
pytest README.md docs`` for the examples alone) ``DATABASE_URL`` names that
backend's database, and the tables an example created are dropped after it.
A fence on an AsyncEngine asks for ``fixture:async_driver`` in its info
string (not shown when rendered) and gets the URL with the database's
asyncio driver.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from pytest_markdown_docs.plugin import MarkdownTextFile

import sa_taskqueue as tq

#: The files whose examples run: the project's front page, at the root.
EXAMPLE_FILES = ("README.md",)
#: ...and every Markdown page of the documentation, at any depth under this directory.
EXAMPLE_DIRS = ("docs",)


def is_example_file(file_path: Path, rootpath: Path) -> bool:
    """README.md at the root, or a ``.md`` page under docs/."""
    if file_path.suffix != ".md":
        return False
    if file_path.parent == rootpath:
        return file_path.name in EXAMPLE_FILES
    return any(file_path.is_relative_to(rootpath / folder) for folder in EXAMPLE_DIRS)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if (
        is_example_file(file_path, parent.config.rootpath)
        and not parent.config.option.markdowndocs  # the plugin collects them itself then
    ):
        return MarkdownTextFile.from_parent(parent, path=file_path)  # type: ignore[no-any-return]
    return None


@pytest.fixture(scope="session")
def example_database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str | None]:
    """The backend's URL for the examples; None on SQLite, where each example keeps its own default file."""
    # tests/conftest.py defines --backend; run alone (`pytest README.md docs`), the file reads the variable.
    name = request.config.getoption(
        "--backend", default=os.environ.get("SA_TASKQUEUE_TEST_BACKEND", "sqlite")
    )
    if name == "sqlite":
        yield None
        return
    if name == "oracle":
        pytest.skip("the examples use plain integer primary keys; Oracle needs an Identity")
    from tests.backends import Unavailable, provision

    try:
        with provision(name, str(tmp_path_factory.mktemp("example-db"))) as found:
            yield found.url
    except Unavailable as error:
        pytest.exit(str(error), returncode=3)


@pytest.fixture(autouse=True)
def _example_setting(request: pytest.FixtureRequest) -> Iterator[None]:
    """An example runs in a temporary directory, with ``DATABASE_URL`` naming the backend's database."""
    if request.node.get_closest_marker("markdown-docs") is None:
        yield
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    url: str | None = request.getfixturevalue("example_database_url")
    monkeypatch.chdir(tmp_path)
    if url is None:
        monkeypatch.delenv("DATABASE_URL", raising=False)
        yield
        return
    definition = getattr(request.node, "test_definition", None)
    if "async_driver" in getattr(definition, "fixture_names", ()):
        from tests.async_drivers import async_url

        monkeypatch.setenv("DATABASE_URL", async_url(url))
    else:
        monkeypatch.setenv("DATABASE_URL", url)
    engine = sa.create_engine(url)
    try:
        before = set(sa.inspect(engine).get_table_names())
        # Each example starts from the empty queue a new application has,
        # whatever earlier tests (or earlier runs) left in the suite's database.
        with engine.begin() as connection:
            for table in reversed(tq.metadata.sorted_tables):
                if table.name in before:
                    connection.execute(table.delete())
        yield
        created = set(sa.inspect(engine).get_table_names()) - before
        if created:
            leftovers = sa.MetaData()
            leftovers.reflect(engine, only=sorted(created))
            leftovers.drop_all(engine)
    finally:
        engine.dispose()


@pytest.fixture
def async_driver() -> None:
    """Named by a fence on an AsyncEngine (``fixture:async_driver``): its ``DATABASE_URL`` is in asyncio form.

    `_example_setting` reads the name from the fence and sets the URL.
    """
