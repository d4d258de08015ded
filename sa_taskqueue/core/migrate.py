"""Run sa_taskqueue's own Alembic migrations, from a checkout or an installed wheel.

The library's table is versioned by its own Alembic environment, with its own
version table (``sa_taskqueue_alembic_version``), so it can share a database
with an application that has its own ``alembic_version`` and its own history.
An application calls `upgrade` at deploy time (the command line does too) and
never needs an ``alembic.ini`` or a copy of our revisions.

This module also holds the autogenerate hooks (`include_object`,
`render_item`) that ``alembic/env.py`` configures, so that the test suite can
compare the migrated schema with the model using exactly the same rules as
``alembic revision --autogenerate`` and ``alembic check`` do.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import alembic.command
import sqlalchemy as sa
from alembic.autogenerate.api import AutogenContext
from alembic.config import Config

from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.model import metadata

#: Our version table: never the application's ``alembic_version``.
VERSION_TABLE = "sa_taskqueue_alembic_version"

#: Tables the library owns; autogenerate ignores everything else in the database.
_OWN_TABLES = frozenset(table.name for table in metadata.tables.values())


def migrations_path() -> Path:
    """The directory holding the Alembic environment (env.py and versions/).

    A wheel force-includes the repository's top-level ``alembic/`` directory
    as ``sa_taskqueue/migrations``; a checkout (or an editable install) has it
    as ``alembic/`` next to the package directory.  The installed copy wins,
    so an installed package never runs revisions from some unrelated checkout.
    """
    package_dir = Path(__file__).resolve().parents[1]
    candidates = (package_dir / "migrations", package_dir.parent / "alembic")
    for candidate in candidates:
        if (candidate / "env.py").is_file():
            return candidate
    looked_in = " and ".join(str(candidate) for candidate in candidates)
    raise FileNotFoundError(
        f"sa_taskqueue's migrations are missing: no env.py in {looked_in}. "
        "Reinstall sa_taskqueue from a wheel, or run from a complete checkout."
    )


def alembic_config(url: str) -> Config:
    """An Alembic `Config` for our migrations and `url`, with no ini file.

    Applications should not need our ``alembic.ini`` (it is not installed).
    Note that ``alembic/env.py`` prefers ``SA_TASKQUEUE_DATABASE_URL`` to the
    ``sqlalchemy.url`` set here, so that the command line can be pointed at a
    database by the environment; `upgrade` and `downgrade` pass a live
    connection instead, so for them `url` always wins.
    """
    config = Config()
    config.set_main_option("script_location", str(migrations_path()))
    # ConfigParser interpolation would read a "%" in a URL-encoded password as
    # the start of a %(name)s reference.
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Migrate the task table in the database at `url` up to `revision`."""
    _run(alembic.command.upgrade, url, revision)


def downgrade(url: str, revision: str = "base") -> None:
    """Migrate the task table at `url` down to `revision` ("base" drops it, and every task)."""
    _run(alembic.command.downgrade, url, revision)


def upgrade_engine(engine: sa.Engine, revision: str = "head") -> None:
    """Migrate the task table up to `revision` through a connection of `engine` (an application's own).

    The engine's pool and connect arguments serve the migration too.  An
    `AsyncEngine`'s ``sync_engine`` connects only on its event loop: run
    this there, through `TaskQueue.run_sync` (as ``sa-taskqueue migrate --app`` does).
    """
    _run_on(engine, alembic.command.upgrade, revision, engine.url.render_as_string(hide_password=False))


def _run(step: Callable[[Config, str], None], url: str, revision: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    # A migration run beside a writing application waits for it as a queue would.
    backend_for(engine.dialect).configure_engine(engine)
    try:
        _run_on(engine, step, revision, url)
    finally:
        engine.dispose()


def _run_on(engine: sa.Engine, step: Callable[[Config, str], None], revision: str, url: str) -> None:
    # A connection of our own, handed to env.py through config.attributes, so
    # the engine's database is the one migrated even when the environment
    # names another; one transaction, committed only if every step succeeded
    # (on databases with transactional DDL).
    config = alembic_config(url)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        step(config, revision)


def include_object(obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """Autogenerate only looks at the library's own tables and their indexes/columns.

    The database is usually the application's: without this, autogenerate would
    propose dropping every application table (and our version table) because
    ``sa_taskqueue.metadata`` does not declare them.
    """
    if type_ == "table":
        return name in _OWN_TABLES
    table = getattr(obj, "table", None)
    return table is None or table.name in _OWN_TABLES


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    """Render our column types as ``UTCDateTime()`` with an import, in new revisions.

    Alembic's default renders ``sa_taskqueue.core.types.UTCDateTime()`` without
    importing ``sa_taskqueue.core.types``, which fails when the revision runs.
    """
    if type_ == "type" and type(obj).__module__ == "sa_taskqueue.core.types":
        name = type(obj).__name__
        if autogen_context.imports is not None:
            autogen_context.imports.add(f"from sa_taskqueue.core.types import {name}")
        return f"{name}()"
    return False


__all__ = [
    "VERSION_TABLE",
    "alembic_config",
    "downgrade",
    "include_object",
    "migrations_path",
    "render_item",
    "upgrade",
    "upgrade_engine",
]
