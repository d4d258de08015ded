"""Alembic environment for sa_taskqueue's own table.

Where the database comes from, first match wins:

1. ``config.attributes["connection"]``: a live Connection handed over by code
   (``sa_taskqueue.core.migrate.upgrade`` does this, and so can an application that
   runs our migrations inside its own transaction);
2. the ``SA_TASKQUEUE_DATABASE_URL`` environment variable (the command line);
3. ``sqlalchemy.url`` in the Alembic config (an ini file, or ``migrate.alembic_config``).

The history is recorded in ``sa_taskqueue_alembic_version``, never in the
application's ``alembic_version``, so both histories can share one database.
This directory has no ``__init__.py`` on purpose: a regular package named
``alembic`` at the repository root would shadow the Alembic library itself.
"""

from __future__ import annotations

import os
from logging.config import fileConfig
from typing import Any

import sqlalchemy as sa
from alembic import context, util

from sa_taskqueue import metadata
from sa_taskqueue.backends import backend_for
from sa_taskqueue.core.migrate import VERSION_TABLE, include_object, render_item

URL_VARIABLE = "SA_TASKQUEUE_DATABASE_URL"

config = context.config

# Only the command line has an ini file; code that calls us keeps its own logging.
if config.config_file_name is not None:
    fileConfig(config.config_file_name)


def database_url() -> str:
    """The URL to migrate: the environment variable, else sqlalchemy.url, else a clear error."""
    url = os.environ.get(URL_VARIABLE) or config.get_main_option("sqlalchemy.url")
    if not url:
        raise util.CommandError(
            f"No database to migrate: set {URL_VARIABLE} to a SQLAlchemy URL, e.g. "
            f"{URL_VARIABLE}=postgresql+psycopg://user@localhost/mydb alembic upgrade head"
        )
    return url


def configure_options(dialect: sa.engine.Dialect) -> dict[str, Any]:
    """Options shared by online and offline runs."""
    return {
        "target_metadata": metadata,
        "version_table": VERSION_TABLE,
        "include_object": include_object,
        "render_item": render_item,
        # Where ALTER TABLE cannot change most things (SQLite), autogenerate
        # must emit batch (copy-and-move) operations; elsewhere it ALTERs in place.
        "render_as_batch": backend_for(dialect).batch_migrations,
    }


def run_migrations_offline() -> None:
    """Emit the migration as SQL (``alembic upgrade head --sql``) without connecting."""
    url = database_url()
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **configure_options(sa.engine.make_url(url).get_dialect()()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Migrate a live database: the connection we were given, or one of our own."""
    connection = config.attributes.get("connection")
    if connection is not None:
        # The caller owns this connection and its transaction (and commits it).
        _run_on(connection)
        return
    engine = sa.create_engine(database_url(), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as own_connection:
            _run_on(own_connection)
    finally:
        engine.dispose()


def _run_on(connection: sa.Connection) -> None:
    context.configure(connection=connection, **configure_options(connection.dialect))
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
