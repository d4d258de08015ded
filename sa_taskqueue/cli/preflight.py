"""What the command line checks before a command reaches a database: the file is there, the driver is.

Two mistakes a person makes at the command line fail confusingly further
in: a mistyped SQLite path (the driver creates an empty file there, and the
command then reports a missing table, leaving the stray file behind), and a
database whose driver is not installed (Python names a module, not the
package to install).  Each gets one line that says what to do.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa

from sa_taskqueue.backends import backend_class, backend_classes, dialect_named_by_alias

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

#: The extra that installs every asyncio driver.
ASYNC_EXTRA = "async"

#: The package extra that installs each driver module, by the module Python failed to import.
_EXTRA_OF_MODULE = {
    **{module: ASYNC_EXTRA for backend in backend_classes() for module in backend.async_driver_modules},
    **{
        module: backend.driver_extra
        for backend in backend_classes()
        if backend.driver_extra is not None
        for module in backend.driver_modules
    },
}

#: SQLAlchemy's default driver for a URL that names none, which no extra
#: installs: the extra installs another driver, named in the URL instead.
_DEFAULT_DRIVERS = {
    backend.unnamed_driver[0]: (backend.driver_extra, backend.unnamed_driver[1])
    for backend in backend_classes()
    if backend.unnamed_driver is not None and backend.driver_extra is not None
}


def missing_database_file(url: str | sa.URL) -> str | None:
    """The path of the database file ``url`` names (SQLite's) when there is no such file, else None.

    Only a file database is checked (`Backend.file_database`): ``:memory:``,
    an empty path (a temporary database) and any other database answer None.
    """
    parsed = sa.make_url(url)
    if not backend_class(parsed.get_backend_name()).file_database:
        return None
    database = parsed.database or ""
    if parsed.query.get("uri") in ("true", "1") or database.startswith("file:"):
        # A URI filename: "file:path?mode=ro", where mode=memory has no file.
        path, _, options = database.removeprefix("file:").partition("?")
        if "mode=memory" in options:
            return None
        database = path
    if database in ("", ":memory:"):
        return None
    return None if Path(database).exists() else database


def missing_database_message(url: str | sa.URL) -> str | None:
    """What to say when the database file ``url`` names is not there (`missing_database_file`), else None."""
    missing = missing_database_file(url)
    if missing is None:
        return None
    return f"no {backend_class(sa.make_url(url).get_backend_name()).label} database at {missing}"


def driver_hint(module: str | None, url: str | sa.URL | None) -> str:
    """What to install when the driver ``module`` (Python's ModuleNotFoundError.name) is missing."""
    top = (module or "").split(".")[0]
    if top in _DEFAULT_DRIVERS:
        default_extra, scheme = _DEFAULT_DRIVERS[top]
        return (
            f"pip install 'sa_taskqueue[{default_extra}]' and write the URL as {scheme}... (or install {top})"
        )
    parsed = _parsed(url)
    # An async driver's extra first: psycopg's async dialect needs psycopg
    # too, but an async application wants everything async installed.
    extra = (
        (ASYNC_EXTRA if parsed is not None and _is_async(parsed) else None)
        or _EXTRA_OF_MODULE.get(top)
        or (backend_class(parsed.get_backend_name()).driver_extra if parsed is not None else None)
    )
    if extra is None:
        return f"install the package that provides {top or 'it'}"
    return f"pip install 'sa_taskqueue[{extra}]'"


def _parsed(url: str | sa.URL | None) -> sa.URL | None:
    if url is None:
        return None
    try:
        return sa.make_url(url)
    except sa.exc.ArgumentError:
        return None


def _is_async(url: sa.URL) -> bool:
    driver = url.drivername.partition("+")[2]  # as written: naming no driver loads nothing
    return driver.startswith(("async", "aio")) or driver.endswith("_async")


def is_async_url(url: str | sa.URL) -> bool:
    """Whether ``url`` names an asyncio driver, which only an `AsyncEngine` can drive.

    SQLAlchemy's dialect class says so (``is_async``), without importing the
    driver; a URL whose dialect cannot be loaded is not async here, and fails
    later with its own error.
    """
    parsed = _parsed(url)
    if parsed is None:
        return False
    try:
        return bool(parsed.get_dialect().is_async)
    except Exception:  # noqa: BLE001 - an unknown dialect: the engine's creation says what is wrong
        return False


def engine_for_url(url: str) -> sa.Engine | AsyncEngine:
    """An engine for ``url``: an `AsyncEngine` when the URL names an asyncio driver.

    A queue runs an async engine's calls on the engine's own event loop
    (`TaskQueue.run_sync`), so a command works on an async URL through the
    driver it names, as on an application whose only engine is async: no
    second, synchronous driver need be installed.
    """
    if is_async_url(url):
        from sqlalchemy.ext.asyncio import create_async_engine  # only an async URL needs it

        return create_async_engine(url)
    return sa.create_engine(url)


def misnamed_dialect_hint(url: str | sa.URL | None) -> str | None:
    """What to write instead when ``url``'s scheme names a database as other tools do (``postgres://``).

    None when the scheme is not such a name.
    """
    parsed = _parsed(url)
    if parsed is None:
        return None
    written, _, driver = parsed.drivername.partition("+")
    name = dialect_named_by_alias(written)
    if name is None:
        return None
    backend = backend_class(name)
    if driver:
        scheme = f"{name}+{driver}://"
    elif backend.unnamed_driver is not None:
        scheme = backend.unnamed_driver[1]
    else:
        scheme = f"{name}://"
    extra = backend.driver_extra if not driver else None
    install = f" (pip install 'sa_taskqueue[{extra}]')" if extra else ""
    return f"SQLAlchemy calls {backend.label} {name}, not {written}: write the URL as {scheme}...{install}"


def is_driver(module: str | None) -> bool:
    """Whether ``module`` is a database driver an extra of this package installs."""
    top = (module or "").split(".")[0]
    return top in _EXTRA_OF_MODULE or top in _DEFAULT_DRIVERS


__all__ = [
    "ASYNC_EXTRA",
    "driver_hint",
    "engine_for_url",
    "is_async_url",
    "is_driver",
    "misnamed_dialect_hint",
    "missing_database_file",
    "missing_database_message",
]
